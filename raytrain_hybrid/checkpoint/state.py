"""Sharded checkpoints with torch.distributed.checkpoint (DCP), loadable under any layout.

Every rank writes its own shards of the model and the AdamW state, keyed by global
parameter names (a stage keeps ``model.layers.3...`` whichever rank holds it), so a
checkpoint saved at (2, 2, 2) loads at (1, 1, 1) or (4, 1, 2): DCP reshards on load.

Layout of ``run.output_dir/checkpoints/step_<N>/`` (N = optimizer steps done):
- ``.metadata`` and ``__<rank>_0.distcp``: DCP's files;
- ``manifest.json``: the step, the config and layout it came from, the data position,
  and every file's size and SHA-256, gathered from all ranks (checkpoint.manifest).

``run.output_dir`` may be a local path, a shared mount or an object-store URI
(raytrain_hybrid.storage); the layout is the same on each, and a checkpoint is complete
only with its manifest (see save_checkpoint for how each backend gets there).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
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
from raytrain_hybrid.storage import Store, as_store, open_store


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


def save_checkpoint(
    trainer, cfg, step: int, *, launch_id: str, data_position: dict | None = None
) -> tuple[Store, dict]:
    """Write checkpoint ``step_<step>`` of this run (every rank calls it); returns its directory
    and timings: ``write_s`` for DCP's write of the shards, ``save_s`` for all of it.

    On a local disk or a shared mount the shards are written in place into ``step_<N>.partial``
    and renamed (atomic). On object storage, where nothing is renamed, each rank writes its
    shards to its own node's disk and uploads them itself (no rank reads another node's disk),
    and rank 0 writes the manifest once every rank's upload is done: a checkpoint is complete
    exactly when its manifest exists."""
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = open_store(cfg.run.output_dir).child("checkpoints")
    final = root.child(f"step_{step}")
    staging = _staging_dir(root, launch_id, step, rank)
    if rank == 0:
        (root.child(f"step_{step}.partial") if root.local else final).delete()  # an attempt that died
        if root.local:
            os.makedirs(staging)
    if not root.local:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    state, _ = _training_state(trainer, rank, with_rng=True)
    dcp.save(state, checkpoint_id=str(staging))
    write_s = time.perf_counter() - t0
    # Each rank hashes the files it wrote (and uploads them); rank 0 records them all.
    mine = {p.name: file_digest(p) for p in staging.iterdir() if p.name.startswith(f"__{rank}_")}
    if rank == 0:
        mine[".metadata"] = file_digest(staging / ".metadata")
    if not root.local:
        final.upload(str(staging))
        shutil.rmtree(staging, ignore_errors=True)
    files: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(files, mine)  # also the barrier after every rank's upload
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
        text = json.dumps(manifest, indent=1) + "\n"
        if root.local:
            (staging / MANIFEST).write_text(text)
            final.delete()  # the same step of an earlier attempt of this run (after a restart)
            os.rename(staging, final.path)  # atomic: the directory appears complete or not at all
        else:
            final.child(MANIFEST).write_text(text)  # last: the checkpoint is complete from here on
    dist.barrier()
    return final, {"write_s": write_s, "save_s": time.perf_counter() - t0}


def _staging_dir(root: Store, launch_id: str, step: int, rank: int) -> Path:
    """Where this rank's DCP files are written: in place beside the final directory on a local
    disk or a mount, else this node's temp dir (one directory per rank: ranks on one node do
    not share it)."""
    if root.local:
        return Path(root.path) / f"step_{step}.partial"
    return Path(tempfile.gettempdir()) / "raytrain-hybrid-ckpt" / launch_id / f"step_{step}" / f"rank{rank}"


def local_copy(path: str | Path | Store) -> Path:
    """A checkpoint directory on this node's disk: itself when local, else downloaded once per
    node (ranks on one node take turns on a lock; the first downloads, the rest reuse it)."""
    import fcntl
    import hashlib

    store = as_store(path, "--resume")
    if store.local:
        return Path(store.path)
    key = hashlib.sha256(store.uri.encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / "raytrain-hybrid-ckpt" / "downloads" / f"{store.name}-{key}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / MANIFEST).exists():
            shutil.rmtree(target, ignore_errors=True)
            store.download(str(target))
    return target


def load_checkpoint(trainer, cfg, path: str | Path | Store) -> dict:
    """Load a verified checkpoint into this rank's modules and optimizer; returns its manifest."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = local_copy(path)
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
