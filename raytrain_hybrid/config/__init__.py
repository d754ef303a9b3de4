"""The run configuration: typed sections (schema), loading (TOML + ``--set``), validation.

``load_config`` returns a validated :class:`Config`; nothing changes it afterwards.
"""

from raytrain_hybrid.config.loader import load_config, parse_overrides
from raytrain_hybrid.config.schema import (
    ARCHS,
    CLASSIFIERS,
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
)
from raytrain_hybrid.config.validate import validate

__all__ = [
    "ARCHS",
    "CLASSIFIERS",
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
    "load_config",
    "parse_overrides",
    "validate",
]
