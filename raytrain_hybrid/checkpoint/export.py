"""Checkpoint -> Hugging Face model directory (config.json + model.safetensors), offline.

Runs in one process without a process group: DCP assembles every parameter whole from the
shards of whatever layout wrote them; the architecture's ``to_hf`` maps the project's names
back to the unmodified transformers model (GPT-2: q/k/v re-fused into Conv1D ``c_attn``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from raytrain_hybrid.checkpoint.manifest import resolve
from raytrain_hybrid.checkpoint.reader import SafeFileSystemReader
from raytrain_hybrid.checkpoint.state import local_copy
from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.common import build_stage
from raytrain_hybrid.storage import Store


def load_full_state_dict(path: str | Path | Store, cfg: Config) -> dict[str, torch.Tensor]:
    """Every model parameter of a checkpoint (local, or on storage: copied here first) as one
    whole float32 tensor (project names)."""
    import torch.distributed.checkpoint as dcp

    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(spec.num_blocks(cfg.model))), first=True, last=True)
    state = {name: torch.empty(p.shape, dtype=torch.float32) for name, p in meta.named_parameters()}
    dcp.load({"model": state}, storage_reader=SafeFileSystemReader(str(local_copy(path))), no_dist=True)
    return state


def export_hf(source: str | Path, out_dir: str | Path) -> Path:
    """Write the model of a checkpoint (or a run directory's newest one) as a HF directory."""
    path, manifest = resolve(source, key="CHECKPOINT")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError("OUT_DIR", str(out), "exists and is not empty; give a new directory (nothing was written)")
    cfg = Config.from_dict(manifest["config"])  # the manifest saves the resolved config
    spec = get_arch(cfg.model.arch)
    if spec.hf_class is None:
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"holds a {cfg.model.arch} model, which has no single transformers class to export to; "
            "load its weights with raytrain_hybrid.checkpoint.export.load_full_state_dict",
        )
    model = spec.hf_class(spec.hf_config(cfg))
    missing, unexpected = model.load_state_dict(spec.to_hf(load_full_state_dict(path, cfg)), strict=False)
    # Only buffers transformers recomputes (rotary frequencies, GPT-2's causal mask) may be absent.
    if unexpected or any(k in dict(model.named_parameters()) for k in missing):
        raise RuntimeError(
            f"checkpoint does not map onto {type(model).__name__}: missing {missing}, extra {unexpected}"
        )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    from raytrain_hybrid.data.tokenizer import resolve_tokenizer

    shutil.copy(resolve_tokenizer(cfg), tmp / "tokenizer.json")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out
