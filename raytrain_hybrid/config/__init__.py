"""The run configuration: typed sections (schema), loading (TOML + ``--set``), defaults that
depend on other keys (resolve_defaults), validation.

``load_config`` = parse, ``resolve_defaults``, ``validate``: it returns a frozen :class:`Config`.
A config built another way (``Config.from_dict``) goes through ``resolve_defaults`` before
``validate``; a saved config (a run's config.json, a checkpoint manifest) is resolved already.
"""

from raytrain_hybrid.config.defaults import resolve_defaults
from raytrain_hybrid.config.loader import load_config, parse_overrides
from raytrain_hybrid.config.schema import (
    ARCHS,
    LAYOUT_KEYS,
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    ZERO_STAGES,
    CheckpointConfig,
    ClusterConfig,
    Config,
    DataConfig,
    ModelConfig,
    ParallelismConfig,
    RunConfig,
    TrainConfig,
    layout_dict,
)
from raytrain_hybrid.config.validate import validate

__all__ = [
    "ARCHS",
    "LAYOUT_KEYS",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "V_SCHEDULES",
    "ZERO_STAGES",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "DataConfig",
    "ModelConfig",
    "ParallelismConfig",
    "RunConfig",
    "TrainConfig",
    "layout_dict",
    "load_config",
    "parse_overrides",
    "resolve_defaults",
    "validate",
]
