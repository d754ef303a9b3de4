"""raytrain_hybrid: DP x TP x PP training of transformers models, orchestrated by Ray.

The names a script uses; everything else is internal and free to move::

    import raytrain_hybrid as rh

    cfg = rh.load_config("jobs/local_3d.toml", ["train.steps=4"])
    rh.check(cfg, topology=[4, 4])          # ranks on nodes, groups per axis (LayoutError if TP crosses a node)
    rh.plan(cfg, world_size=16, hardware="h100")[0]   # the cost model's best layout
    summary = rh.train(cfg)                 # on Ray: the local cluster, or $RAY_ADDRESS
    rh.export(cfg.run.output_dir, "hf_out")  # newest checkpoint -> transformers directory
"""

from __future__ import annotations

import logging
from pathlib import Path

from raytrain_hybrid.config import Config, load_config
from raytrain_hybrid.distributed.parallel_dims import ParallelDims
from raytrain_hybrid.errors import ConfigError, LayoutError
from raytrain_hybrid.models.custom import register_model

__all__ = [
    "Config",
    "ConfigError",
    "LayoutError",
    "ParallelDims",
    "check",
    "export",
    "load_config",
    "plan",
    "register_model",
    "train",
]
__version__ = "0.1.0"

# transformers imports torchao (train.fp8) wherever it is installed, and torchao's import logs a
# warning for every GPU kernel library it cannot load (all of them on a CPU) and torch one for each
# enum torchao registers with it: lines on every run's stderr that say nothing of the run.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
del _name


def check(cfg: Config, topology: list[int] | None = None, hardware: str | None = None) -> dict:
    """Place ``cfg``'s layout on nodes holding ``topology`` workers each (default: one node).

    Returns ``{"ranks": [{rank, node, pp, dp, tp}], "groups": {axis: [[ranks]]}}`` and, with a
    ``hardware`` profile name or JSON file, ``"planner"``: the cost model's memory and
    throughput line. Raises :class:`LayoutError` when a TP group would cross a node. (The
    config itself was checked by :func:`load_config`.)
    """
    from raytrain_hybrid.distributed.parallel_dims import placement_report

    dims = ParallelDims.from_config(cfg.parallelism)
    report = placement_report(dims, topology or [dims.world_size])
    if hardware:
        from raytrain_hybrid.planner.hardware import load_hardware
        from raytrain_hybrid.planner.search import describe

        report["planner"] = describe(cfg, load_hardware(hardware))
    return report


def train(cfg: Config, resume: str | None = None) -> dict:
    """Train ``cfg`` on Ray Train (joins ``cluster.address`` / ``$RAY_ADDRESS``, else starts a
    local cluster); writes metrics.jsonl, summary.json and checkpoints to ``run.output_dir``
    and returns the summary. ``resume``: a run directory or checkpoint to continue."""
    from raytrain_hybrid.launch.driver import run

    return run(cfg, resume=resume)


def plan(cfg: Config, world_size: int, hardware: str = "h100", gpus_per_node: int = 8) -> list[dict]:
    """Every layout of ``world_size`` ranks for ``cfg``'s model and batch, priced by the cost
    model on a hardware profile (a name such as "h100", or a calibrated JSON file), best first."""
    import dataclasses

    from raytrain_hybrid.planner.hardware import load_hardware
    from raytrain_hybrid.planner.search import plan as search

    hw = dataclasses.replace(load_hardware(hardware), gpus_per_node=gpus_per_node)
    return search(cfg, world_size, hw)


def export(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """A checkpoint (or a run directory: its newest) as a Hugging Face model directory."""
    from raytrain_hybrid.checkpoint.export import export_hf

    return export_hf(checkpoint, out_dir)
