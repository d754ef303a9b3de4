"""Checkpoint -> Hugging Face model directory (config.json + model.safetensors), offline.

A model fine-tuned from ``model.pretrained`` keeps that checkpoint's settings (its config.json
through the spec's hf_config), tokenizer files, chat template and generation_config.json, so
``transformers.pipeline("text-generation", model=OUT_DIR)`` runs on it. A family on the generic path
keeps its own tying (the engine's head copy equals the embedding: engine.tied); the hand-written specs
write the head untied (they train embedding and head as two matrices). Dropout probabilities, off
while training, are the source's again (``source_dropout``).

Runs in one process without a process group: DCP assembles every parameter whole from the
shards of whatever layout wrote them; the architecture's ``to_hf`` maps the project's names
back to the unmodified transformers model (GPT-2: q/k/v re-fused into Conv1D ``c_attn``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from raytrain_hybrid.checkpoint.manifest import resolve
from raytrain_hybrid.checkpoint.reader import safe_load
from raytrain_hybrid.checkpoint.shapes import check_shapes
from raytrain_hybrid.config import Config, validate
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import get_arch, hf_checkpoint, hub
from raytrain_hybrid.models.common import build_stage
from raytrain_hybrid.models.generic import DROPOUT_KEYS
from raytrain_hybrid.storage import Store, as_store, private_dir


def load_full_state_dict(path: str | Path | Store, cfg: Config) -> dict[str, torch.Tensor]:
    """Every model parameter of a checkpoint (local, or read by range from storage) as one
    whole float32 tensor (project names)."""
    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(spec.num_blocks(cfg.model))), first=True, last=True)
    state = {name: torch.empty(p.shape, dtype=torch.float32) for name, p in meta.named_parameters()}
    safe_load({"model": state}, path, no_dist=True)
    return state


# What a Hugging Face model directory holds besides the weights and config.json.
COMPANIONS = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def copy_companions(pretrained: str, out: Path, revision: str = "") -> None:
    """Copy the checkpoint's tokenizer and generation files (local, on storage, or a Hub id's,
    fetched into this machine's Hugging Face cache without the weights) into ``out``."""
    if hub.is_hub_id(pretrained):
        pretrained = str(hub.snapshot(pretrained, revision, weights=False))
    store = as_store(pretrained, "model.pretrained")
    have = set(store.listdir())
    if "config.json" not in have:
        raise ConfigError("model.pretrained", pretrained, "is gone: export needs its tokenizer files")
    for name in COMPANIONS:
        if name in have:
            (out / name).write_bytes(store.child(name).read_bytes())


def _target(out_dir: str | Path) -> Store:
    """OUT_DIR opened (a local path or a storage URI), refused before anything is read or
    written when it is a file or a directory with something in it."""
    out = as_store(out_dir, "OUT_DIR")
    if out.is_file():
        raise ConfigError("OUT_DIR", out.uri, "is a file; give a new directory (nothing was written)")
    if out.listdir():
        raise ConfigError("OUT_DIR", out.uri, "exists and is not empty; give a new directory (nothing was written)")
    if out.local:
        for parent in Path(out.path).parents:  # a file on the way: mkdir would fail after the load
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError("OUT_DIR", out.uri, f"cannot be made: {parent} is a file")
                break
    return out


def export_hf(source: str | Path, out_dir: str | Path, merge: bool = False) -> str:
    """Write the model of a checkpoint (or a run directory's newest one) as a HF directory:
    a local path, or a storage URI (s3://bucket/model: written here, then uploaded, config.json
    last, so a directory with config.json is whole). A LoRA run's checkpoint is written as a
    PEFT adapter directory, or with ``merge`` as the pretrained model with its adapters merged
    in (checkpoint.export_lora). Returns where it went."""
    target = _target(out_dir)
    path, manifest = resolve(source, key="CHECKPOINT")
    try:  # the manifest saves the resolved config, valid when it was saved
        cfg = Config.from_dict(manifest["config"])
        validate(cfg)
    except (KeyError, TypeError, ValueError) as exc:  # ConfigError, and validate's "not resolved"
        raise ConfigError("CHECKPOINT", str(path), f"has a manifest.json whose config cannot be read: {exc}") from None
    spec = get_arch(cfg.model.arch)
    if cfg.lora.rank:
        from raytrain_hybrid.checkpoint.export_lora import lora_writer

        return _publish(target, lora_writer(path, cfg, merge), cfg, spec)
    if merge:
        raise ConfigError(
            "--merge", True, f"the checkpoint {path} is not a LoRA run's (lora.rank=0): export it without --merge"
        )
    if spec.hf_class is None:
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"holds a {cfg.model.arch} model, which has no single transformers class to export to; "
            "load its weights with raytrain_hybrid.checkpoint.export.load_full_state_dict",
        )
    check_shapes(path, cfg, "CHECKPOINT", optimizer=False)
    model = spec.hf_class(spec.hf_config(cfg))
    try:
        weights = load_full_state_dict(path, cfg)
    except (CheckpointException, ValueError, RuntimeError) as exc:  # DCP's, a BaseException: one line of it
        last = [line for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
        raise ConfigError(
            "CHECKPOINT", str(path), f"its shards do not hold the model its manifest.json describes: {last[0].strip()}"
        ) from None
    missing, unexpected = model.load_state_dict(spec.to_hf(weights), strict=False)
    # Only buffers transformers recomputes (rotary frequencies, GPT-2's causal mask) may be absent.
    if unexpected or any(k in dict(model.named_parameters()) for k in missing):
        raise RuntimeError(
            f"checkpoint does not map onto {type(model).__name__}: missing {missing}, extra {unexpected}"
        )

    source_dropout(model.config, cfg)

    def write(tmp: Path) -> str:
        model.config.use_cache = True  # generation wants its KV cache (training turned it off)
        model.save_pretrained(tmp, safe_serialization=True)
        return "config.json"

    return _publish(target, write, cfg, spec)


def source_dropout(config, cfg: Config) -> None:
    """The source checkpoint's dropout probabilities back on the exported config: training set them
    to 0 (every layout must draw the same masks), but the model given back is the source's, which a
    later fine-tune elsewhere would train with its own settings."""
    if not hf_checkpoint.is_set(cfg.model.pretrained):
        return
    source = hf_checkpoint.read_config_json(cfg.model.pretrained, cfg.model.pretrained_revision)
    for key, value in source.items():
        if isinstance(value, float) and key.endswith(DROPOUT_KEYS) and hasattr(config, key):
            setattr(config, key, value)


def _publish(target: Store, write, cfg: Config, spec) -> str:
    """``write(staging directory)`` (it returns the file a reader opens first, written last to
    storage), the tokenizer files added, then the directory moved or uploaded to ``target``."""
    if target.local:
        out = Path(target.path)
        tmp = out.with_name(out.name + ".partial")
    else:  # staged in this user's private directory, one per export
        tmp = private_dir("export", f"{os.getpid()}-{time.time_ns()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        first = write(tmp)
        if hf_checkpoint.is_set(cfg.model.pretrained) and spec.from_hf is not None:
            # The checkpoint's tokenizer files, chat template and generation settings, as they were.
            copy_companions(cfg.model.pretrained, tmp)
        else:
            from raytrain_hybrid.data.tokenizer import resolve_tokenizer

            shutil.copy(resolve_tokenizer(cfg), tmp / "tokenizer.json")
        if target.local:
            if out.exists():
                out.rmdir()
            tmp.rename(out)
            return str(out)
        config = (tmp / first).read_bytes()
        (tmp / first).unlink()
        target.upload(str(tmp))
        target.child(first).write_bytes(config)  # last: what transformers (or peft) opens first
        return target.uri
    finally:
        if not target.local:
            shutil.rmtree(tmp, ignore_errors=True)
