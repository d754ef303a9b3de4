"""A checkpoint's tensors against the model its manifest describes, on the driver.

The manifest's config says which model the shards hold, and a resume or an export builds that model;
a manifest edited (or a shard written by another run) so that the two disagree would otherwise fail
in every worker with a traceback, after Ray started. Checked from the DCP metadata alone (checked
data: checkpoint.reader) and the model built on the meta device: no tensor is read or allocated."""

from __future__ import annotations

import math

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import Store

# What AdamW keeps per trainable parameter (checkpoint.state.optimizer_state), which a resume loads.
OPTIMIZER_KEYS = ("step", "exp_avg", "exp_avg_sq")


def check_shapes(path: Store, cfg, key: str, *, optimizer: bool) -> None:
    """Refuse (``key``: the CLI's name for the checkpoint) a checkpoint whose shards cannot hold the
    model its manifest's config ``cfg`` describes: first roughly, in parameters (a config edited to
    a huge model would otherwise be built), then every parameter's shape; with ``optimizer`` (a
    resume), also every trainable parameter's AdamW state. A LoRA run's checkpoint holds its adapters
    only, which the model built here has not: they are not checked here (a worker's load names a
    misfit)."""
    from raytrain_hybrid.checkpoint.reader import METADATA, parse_metadata
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage  # (torch: imported when a resume is checked)
    from raytrain_hybrid.models.params import param_count

    md = parse_metadata(path.child(METADATA).read_bytes())  # checked by manifest.verify already
    stored = {k: tuple(m.size) for k, m in md.state_dict_metadata.items() if hasattr(m, "size")}
    held = {k.removeprefix("model."): s for k, s in stored.items() if k.startswith("model.")}
    adapters = cfg.lora.rank > 0
    if not adapters:
        described = param_count(cfg.model)  # (a pretrained gpt2's positions are its own: not exact)
        if described > 2 * sum(math.prod(s) for s in held.values()) + 2**20:
            what = f"its manifest.json describes a model of {described:,} parameters, far more than its shards hold"
            raise ConfigError(key, str(path), what)
    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(spec.num_blocks(cfg.model))), first=True, last=True)
    for name, p in meta.named_parameters():
        if adapters and name not in held:  # (the frozen base is the pretrained checkpoint's, not saved)
            continue
        if held.get(name) != tuple(p.shape):
            have = f"holds {list(held[name])}" if name in held else "does not hold it"
            raise ConfigError(
                key, str(path), f"its manifest.json describes {name} as {list(p.shape)}, and the checkpoint {have}"
            )
        if optimizer and not adapters:
            missing = [k for k in OPTIMIZER_KEYS if f"optimizer.{name}.{k}" not in stored]
            if missing:
                raise ConfigError(
                    key,
                    str(path),
                    f"holds no optimizer state ({', '.join(missing)}) for {name}, which a resume loads; "
                    "export its weights instead (raytrain-hybrid export)",
                )
