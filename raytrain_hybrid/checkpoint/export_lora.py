"""A LoRA run's checkpoint -> a PEFT adapter directory, or merged full weights (``export --merge``).

The checkpoint holds the adapters only (checkpoint.state); the base is model.pretrained.

- Without ``--merge``: ``adapter_config.json`` (peft's own ``LoraConfig``, with
  ``base_model_name_or_path`` = model.pretrained) and ``adapter_model.safetensors`` under peft's
  names (``base_model.model.<module>.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base, OUT_DIR)`` loads onto the pretrained model; the
  checkpoint's tokenizer files beside them.
- With ``--merge``: the pretrained model with every adapter folded into its linear
  (W + alpha/r * B @ A, peft's ``merge_and_unload``), written as a Hugging Face model directory
  that transformers loads alone; the tokenizer files and generation settings as export writes them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from raytrain_hybrid.checkpoint.reader import safe_load
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import get_arch, hub
from raytrain_hybrid.models.common import build_stage
from raytrain_hybrid.models.lora import ADAPTER, inject, is_adapter, peft_config
from raytrain_hybrid.storage import Store, as_store, is_uri

PEFT_PREFIX = "base_model.model."


def adapter_state(path: str | Path | Store, cfg) -> dict[str, torch.Tensor]:
    """Every adapter of a LoRA checkpoint as a whole float32 tensor (the engine's names:
    ``...q_proj.lora_A.default.weight``), from the shards of whatever layout wrote them."""
    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(spec.num_blocks(cfg.model))), first=True, last=True)
    inject(meta, spec, cfg.lora)
    state = {n: torch.empty(p.shape, dtype=torch.float32) for n, p in meta.named_parameters() if is_adapter(n)}
    try:
        safe_load({"model": state}, path, no_dist=True)
    except (CheckpointException, ValueError, RuntimeError) as exc:  # DCP's, a BaseException: one line of it
        last = [line for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"its shards do not hold the adapters its manifest.json describes: {last[0].strip()}",
        ) from None
    return state


def write_adapter(state: dict[str, torch.Tensor], cfg, out: Path) -> None:
    """adapter_config.json and adapter_model.safetensors, as peft's save_pretrained writes them."""
    from safetensors.torch import save_file

    config = peft_config(cfg.lora, get_arch(cfg.model.arch))
    config.base_model_name_or_path = cfg.model.pretrained
    config.revision = cfg.model.pretrained_revision or None
    config.task_type = "CAUSAL_LM"
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    tensors = {PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): t.contiguous() for n, t in sorted(state.items())}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def _local_base(cfg, scratch: Path) -> str:
    """model.pretrained as a local directory transformers reads (a Hub id's snapshot, a storage
    URI copied into ``scratch``)."""
    where = cfg.model.pretrained
    if hub.is_hub_id(where):
        return str(hub.snapshot(where, cfg.model.pretrained_revision))
    if is_uri(where):
        as_store(where, "model.pretrained").download(str(scratch / "base"))
        return str(scratch / "base")
    if not (Path(where) / "config.json").is_file():
        raise ConfigError("model.pretrained", where, "is gone: export --merge needs the base model the adapters adapt")
    return where


def write_merged(state: dict[str, torch.Tensor], cfg, out: Path) -> None:
    """The pretrained model with the adapters merged in, saved as a Hugging Face directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="lora-export-") as scratch:
        base_dir = _local_base(cfg, Path(scratch))
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
        write_adapter(state, cfg, Path(scratch) / "adapter")
        merged = PeftModel.from_pretrained(base, str(Path(scratch) / "adapter")).merge_and_unload()
        merged.config.use_cache = True  # generation wants its KV cache (training turned it off)
        merged.save_pretrained(str(out), safe_serialization=True)


def lora_writer(path: Store, cfg, merge: bool):
    """What export writes for a LoRA checkpoint: a function of the staging directory."""
    state = adapter_state(path, cfg)

    def write(out: Path) -> str:
        if merge:
            write_merged(state, cfg, out)
            return "config.json"
        write_adapter(state, cfg, out)
        return "adapter_config.json"

    return write
