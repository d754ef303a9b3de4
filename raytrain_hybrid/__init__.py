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


def check(
    cfg: Config,
    topology: list[int] | None = None,
    hardware: str | None = None,
    *,
    resume: str | None = None,
    allow_change: list[str] | None = None,
) -> dict:
    """Place ``cfg``'s layout on nodes and make the run plan ``train`` would run on them, as
    ``raytrain-hybrid check --topology`` does: nothing is started or written.

    Args:
        cfg: a config from :func:`load_config` (which has checked the config itself).
        topology: workers per node, e.g. ``[4, 4]``; default one node holding every rank.
        hardware: a hardware profile name ("h100", "a100-80", ...) or a calibrated JSON file:
            adds the cost model's memory and throughput line.
        resume: a checkpoint or run directory to continue from, checked as ``train --resume``
            checks it.
        allow_change: trajectory keys the resume may change on purpose (``--allow-change``).

    Returns:
        ``{"ranks": [{rank, node, pp, dp, tp}], "groups": {axis: [[ranks]]}, "totals": {...},
        "plan": RunPlan, "said": [lines]}``, and ``"planner"`` (a line of text) with ``hardware``.
        At most 256 ranks, and per axis 64 groups of at most 64 ranks, are listed; ``totals``
        counts them all (``{"ranks": N, axis: {"groups": G, "size": S}}``). ``plan`` is the
        frozen plan ``train`` derives (its ``lines()``, as ``check`` prints them, and
        ``to_json()``, as ``check --json`` prints it); ``said``: what ``train`` would say
        before its start (warnings, what could not be verified here).

    Raises:
        LayoutError: a TP group would cross a node.
        ConfigError: what ``train`` refuses before its first step (missing data, an output
            directory holding another run's checkpoints or lease, a resume that changes the run).
    """
    from raytrain_hybrid.distributed.parallel_dims import placement_report
    from raytrain_hybrid.errors import redact
    from raytrain_hybrid.launch.runtime.startcheck import check_layout, check_plan

    dims = ParallelDims.from_config(cfg.parallelism)
    nodes = topology or [dims.world_size]
    report = placement_report(dims, nodes)
    if hardware:
        from raytrain_hybrid.planner.hardware import load_hardware
        from raytrain_hybrid.planner.search import describe

        report["planner"] = describe(cfg, load_hardware(hardware))
    said, notes = [], []
    at, _, reach = check_layout(cfg, nodes, said.append)  # layout="auto": the planner's pick for these nodes
    report["plan"] = check_plan(at, cfg, nodes, resume, allow_change or [], notes, said.append, reach)
    report["said"] = [redact(line) for line in [*said, *(f"not verified: {n}" for n in notes)]]
    return report


def train(cfg: Config, resume: str | None = None, allow_change: list[str] | None = None) -> dict:
    """Train ``cfg`` on Ray Train, as ``raytrain-hybrid train`` does.

    Joins ``cluster.address`` / ``$RAY_ADDRESS``, else starts a local cluster; writes
    metrics.jsonl, summary.json and checkpoints to ``run.output_dir``.

    Args:
        cfg: a config from :func:`load_config`.
        resume: a run directory (its newest checkpoint) or a ``checkpoints/step_<N>`` directory
            to continue from; any layout, the same model (the CLI's ``--resume``).
        allow_change: with ``resume``, the keys that may differ from the checkpoint's on purpose,
            e.g. ``["train.lr", "data.path"]`` (the CLI's ``--allow-change``); a data or batch-size
            change starts the data from its beginning.

    Returns:
        The run's summary (what summary.json holds): steps, final loss, tokens/s, per-rank
        memory, checkpoints, start-up phases.

    Raises:
        ConfigError: an input, a resume or an output directory refused before the first step.
    """
    from raytrain_hybrid.launch.runtime.driver import run

    if cfg.fault_tolerance.enabled:  # one replica group, as a `train` with its group number is
        from raytrain_hybrid.launch.runtime.lighthouse import group_launch

        cfg = group_launch(cfg, None, "")
    return run(cfg, resume=resume, allow_change=allow_change)


def plan(cfg: Config, world_size: int, hardware: str = "h100", gpus_per_node: int = 8) -> list[dict]:
    """Every layout of ``world_size`` ranks for ``cfg``'s model and batch, priced by the cost
    model, as ``raytrain-hybrid plan`` does.

    Args:
        cfg: a config from :func:`load_config` (its model and batch; its layout is ignored).
        world_size: the number of ranks (GPUs) to lay out.
        hardware: a profile name ("h100", "h100-96", "a100-80", "a100-40") or a calibrated JSON file.
        gpus_per_node: GPUs per node (TP groups stay inside one).

    Returns:
        One dict per layout, best first: its degrees, schedule, micro-batches and ZeRO stage,
        ``feasible`` and ``reason``, ``memory_bytes``, ``predicted_tokens_per_s``, ``predicted_mfu``.
    """
    import dataclasses

    from raytrain_hybrid.planner.hardware import load_hardware
    from raytrain_hybrid.planner.search import plan as search

    hw = dataclasses.replace(load_hardware(hardware), gpus_per_node=gpus_per_node)
    return search(cfg, world_size, hw)


def export(checkpoint: str | Path, out_dir: str | Path, merge: bool = False) -> str:
    """A checkpoint as a Hugging Face model directory, as ``raytrain-hybrid export`` does.

    Args:
        checkpoint: a ``checkpoints/step_<N>`` directory, or a run directory (its newest).
        out_dir: a new directory (a local path or a storage URI).
        merge: of a LoRA run (``lora.rank > 0``): the pretrained model with the adapters merged
            into its weights, which transformers loads alone (the CLI's ``--merge``); without it, a
            PEFT adapter directory for ``peft.PeftModel.from_pretrained`` on the base model.

    Returns:
        Where it was written (``out_dir``, as a string).

    Raises:
        ConfigError: an unreadable checkpoint, or ``merge`` of a run without LoRA.
    """
    from raytrain_hybrid.checkpoint.export import export_hf

    return export_hf(checkpoint, out_dir, merge=merge)
