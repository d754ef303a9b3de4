"""Sharded checkpoints with torch.distributed.checkpoint (DCP), loadable under any layout.

Every rank writes its own shards of the model and the AdamW state, keyed by global
parameter names (a stage keeps ``model.layers.3...`` whichever rank holds it), so a
checkpoint saved at (2, 2, 2) loads at (1, 1, 1) or (4, 1, 2): DCP reshards on load.

Layout of ``run.output_dir/checkpoints/step_<N>/`` (N = optimizer steps done):
- ``.metadata`` and ``__<rank>_0.distcp``: DCP's files;
- ``manifest.json``: the step, the config and layout it came from, the data position,
  and every file's size and SHA-256, gathered from all ranks (checkpoint.manifest).

A save goes to ``step_<N>.partial/`` and is renamed to ``step_<N>`` by rank 0 once
every rank's files and the manifest are written, so a crash mid-write never leaves a
directory that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from raytrain_hybrid.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    file_digest,
    layout_of,
    read_manifest,
)
from raytrain_hybrid.checkpoint.reader import SafeFileSystemReader


def _fqn(name: str) -> str:
    """A parameter's global name: without activation-checkpoint and DDP wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def model_state(modules) -> list[dict[str, torch.Tensor]]:
    """One state dict per stage module this rank holds (global names, DTensor shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [get_model_state_dict(m) for m in modules]


def optimizer_state(modules, optimizer) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state under global names, created (zeros, step 0) where the
    optimizer has not stepped yet, so that DCP can load into it. ZeRO-1 keeps flat slices
    per DP rank; it hands out (all-gathered) per-parameter state in the same form, so a
    checkpoint reshards to any layout and ZeRO stage."""
    gathered = optimizer.gathered_state() if hasattr(optimizer, "gathered_state") else None
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, p in module.named_parameters():
            if gathered is not None:
                state = gathered[id(p)]
            else:
                state = optimizer.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                out[f"{_fqn(name)}.{key}"] = state[key]
    return out


def _scatter_optimizer_state(modules, optimizer, flat: dict[str, torch.Tensor]) -> None:
    """After a load: hand ZeRO-1 its loaded per-parameter state back (others load in place)."""
    if not hasattr(optimizer, "scatter_state"):
        return
    per_param = {}
    for module in modules:
        for name, p in module.named_parameters():
            per_param[id(p)] = {key: flat[f"{_fqn(name)}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")}
    optimizer.scatter_state(per_param)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _training_state(trainer, rank: int, with_rng: bool) -> tuple[dict, list[dict]]:
    per_module = model_state(trainer.modules)
    state: dict[str, Any] = {
        "model": {k: v for sd in per_module for k, v in sd.items()},
        "optimizer": optimizer_state(trainer.modules, trainer.optimizer),
    }
    if with_rng:  # per rank: meaningful only when loaded by the same rank of the same layout
        state["rng"] = {f"rank{rank}": _rng_state(trainer.device)}
    return state, per_module


def save_checkpoint(trainer, cfg, step: int, *, launch_id: str, data_position: dict | None = None) -> tuple[Path, dict]:
    """Write checkpoint ``step_<step>`` of this run (every rank calls it); returns its directory
    and timings: ``write_s`` for DCP's write of the shards, ``save_s`` for all of it."""
    import time

    t0 = time.perf_counter()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(cfg.run.output_dir).resolve() / "checkpoints"
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save that died before this one
        partial.mkdir(parents=True)
    dist.barrier()
    state, _ = _training_state(trainer, rank, with_rng=True)
    dcp.save(state, checkpoint_id=str(partial))
    write_s = time.perf_counter() - t0
    # Each rank hashes the files it wrote; rank 0 records them all.
    mine = {p.name: file_digest(p) for p in partial.iterdir() if p.name.startswith(f"__{rank}_")}
    if rank == 0:
        mine[".metadata"] = file_digest(partial / ".metadata")
    files: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(files, mine)
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "launch_id": launch_id,
            "world_size": world,
            "layout": layout_of(cfg),
            "config": cfg.to_dict(),
            "data_position": data_position or {},
            "files": {name: d for part in files for name, d in part.items()},
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if final.exists():  # the same step of an earlier attempt of this run (after a restart)
            shutil.rmtree(final)
        os.rename(partial, final)  # atomic: the directory appears complete or not at all
    dist.barrier()
    return final, {"write_s": write_s, "save_s": time.perf_counter() - t0}


def load_checkpoint(trainer, cfg, path: str | Path) -> dict:
    """Load a verified checkpoint into this rank's modules and optimizer; returns its manifest."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(path)
    manifest = read_manifest(path)
    rank = dist.get_rank()
    same_layout = manifest["world_size"] == dist.get_world_size() and manifest["layout"] == layout_of(cfg)
    state, per_module = _training_state(trainer, rank, with_rng=same_layout)
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    for module, sd in zip(trainer.modules, per_module, strict=True):
        set_model_state_dict(module, sd, options=StateDictOptions(strict=True))
    _scatter_optimizer_state(trainer.modules, trainer.optimizer, state["optimizer"])
    if same_layout:
        rng = state["rng"][f"rank{rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)
    trainer.restore_schedule(manifest["step"])
    return manifest
