"""Sharded checkpoints with torch.distributed.checkpoint (DCP), loadable under any layout.

Every rank writes its own shards of the model and the AdamW state, keyed by global
parameter names (a stage keeps ``model.layers.3...`` whichever rank holds it), so a
checkpoint saved at (2, 2, 2) loads at (1, 1, 1) or (4, 1, 2): DCP reshards on load.

Layout of ``run.output_dir/checkpoints/step_<N>/`` (N = optimizer steps done):
- ``.metadata`` and ``__<rank>_0.distcp``: DCP's files;
- a LoRA run's (``lora.rank`` > 0) shards hold its adapters and their AdamW state only: the
  frozen base is model.pretrained's, read again on resume;
- ``manifest.json``: the step, the config and layout it came from, the data position,
  and every file's size and SHA-256, gathered from all ranks (checkpoint.manifest).

``run.output_dir`` may be a local path, a shared mount or an object-store URI
(raytrain_hybrid.storage); the layout is the same on each, and a checkpoint is complete
only with its manifest (checkpoint.save writes them, blocking the step loop only for a
copy of the state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raytrain_hybrid.checkpoint.manifest import layout_of, verify
from raytrain_hybrid.checkpoint.reader import safe_load
from raytrain_hybrid.models.lora import is_adapter
from raytrain_hybrid.storage import Store


def _fqn(name: str) -> str:
    """A parameter's global name: without activation-checkpoint and DDP wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def model_state(modules, adapters_only: bool = False) -> list[dict[str, torch.Tensor]]:
    """One state dict per stage module this rank holds (global names, DTensor shards); of a
    LoRA run (``adapters_only``) its adapters alone: the frozen base is model.pretrained's."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    states = [get_model_state_dict(m) for m in modules]
    if adapters_only:
        states = [{k: v for k, v in sd.items() if is_adapter(k)} for sd in states]
    return states


def optimizer_state(modules, optimizer) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state under global names, created (zeros, step 0) where the
    optimizer has not stepped yet, so that DCP can load into it. ZeRO-1 keeps flat slices
    per DP rank; it hands out (all-gathered) per-parameter state in the same form, so a
    checkpoint reshards to any layout and ZeRO stage."""
    gathered = optimizer.gathered_state() if hasattr(optimizer, "gathered_state") else None
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad:  # frozen (a LoRA run's base): no optimizer state
                continue
            if gathered is not None:
                state = gathered[id(p)]
            else:
                state = optimizer.state[p]
                if not state:
                    # Where AdamW keeps it: on the parameter's device for the fused kernel (CUDA).
                    fused = optimizer.defaults.get("fused")
                    state["step"] = torch.tensor(0.0, device=p.device if fused else "cpu")
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
            if not p.requires_grad:
                continue
            per_param[id(p)] = {key: flat[f"{_fqn(name)}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")}
    optimizer.scatter_state(per_param)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def training_state(trainer, rank: int, with_rng: bool) -> tuple[dict, list[dict]]:
    """What a checkpoint holds of this rank (model shards, AdamW state, RNG), under global
    names; and the per-module model state dicts (a load hands them back to their modules)."""
    per_module = model_state(trainer.modules, adapters_only=trainer.cfg.lora.rank > 0)
    state: dict[str, Any] = {
        "model": {k: v for sd in per_module for k, v in sd.items()},
        "optimizer": optimizer_state(trainer.modules, trainer.optimizer),
    }
    if with_rng:  # per rank: meaningful only when loaded by the same rank of the same layout
        state["rng"] = {f"rank{rank}": _rng_state(trainer.device)}
    return state, per_module


def load_checkpoint(trainer, cfg, path: str | Path | Store) -> dict:
    """Load a verified checkpoint into this rank's modules and optimizer; returns its manifest."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # Sizes against the manifest and the metadata read as data, on every rank (a restart or an
    # elastic resize comes here without the driver's check; a listing and one small file).
    manifest = verify(path, digests=False)
    rank = dist.get_rank()
    same_layout = manifest["world_size"] == dist.get_world_size() and manifest.get("layout") == layout_of(cfg)
    state, per_module = training_state(trainer, rank, with_rng=same_layout)
    # Straight from storage: this rank's byte ranges only (checkpoint.reader), nothing copied to disk.
    safe_load(state, path)
    for module, sd in zip(trainer.modules, per_module, strict=True):
        # A LoRA checkpoint holds the adapters only (the base was read from model.pretrained).
        set_model_state_dict(module, sd, options=StateDictOptions(strict=not cfg.lora.rank))
    _scatter_optimizer_state(trainer.modules, trainer.optimizer, state["optimizer"])
    if same_layout:
        rng = state["rng"][f"rank{rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)
    trainer.restore_schedule(manifest["step"])
    return manifest
