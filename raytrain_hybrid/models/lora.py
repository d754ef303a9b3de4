"""LoRA adapters (``[lora]``), model side: which linears an architecture adapts, peft's
injection into a stage, the names, and the adapters' initial values.

The adapters are peft's own layers (``peft.tuners.lora.Linear``), injected into each
meta-device stage before TP, so a stage's names are peft's: ``...q_proj.base_layer.weight``
(the frozen pretrained linear) and ``...q_proj.lora_A.default.weight`` /
``...q_proj.lora_B.default.weight`` (the trained ones). How A and B are laid out under TP is
distributed/lora.py's; what the engine trains is only those adapters.
"""

from __future__ import annotations

import math
import zlib

from raytrain_hybrid.models import get_arch

ADAPTER = "default"  # peft's adapter name: the one adapter a run trains
ALL_LINEAR = "all-linear"
_BASE = ".base_layer"


def adaptable(spec) -> dict[str, str]:
    """Block linears LoRA can adapt: {module path in a block: "colwise" | "rowwise"}. A linear
    qualifies when the pretrained checkpoint holds its weight as itself (same name, not
    transposed, not a block of a fused tensor), so a peft adapter names the same module."""
    if spec.task != "lm" or spec.from_hf is None or spec.hf_class is None:
        return {}
    out = {}
    for path, style in spec.tp_plan.items():
        if style not in ("colwise", "rowwise"):
            continue
        name = f"{spec.layers}.0.{path}.weight"
        try:
            keys, transposed, offset = spec.from_hf(name, {"n_embd": 1})
        except (KeyError, ValueError):
            continue
        if keys[0] == name and not transposed and not offset:
            out[path] = style
    return out


def target_names(spec) -> tuple[str, ...]:
    """The names ``lora.targets`` may give (the last part of each adaptable path)."""
    return tuple(path.rpartition(".")[2] for path in adaptable(spec))


def targeted(spec, targets) -> dict[str, str]:
    """The adaptable paths ``targets`` select ("all-linear": every one; a name matches a path
    equal to it or ending in ``.<name>``, as peft matches)."""
    paths = adaptable(spec)
    if ALL_LINEAR in targets:
        return paths
    return {p: s for p, s in paths.items() if any(p == t or p.endswith(f".{t}") for t in targets)}


def unmatched(spec, targets) -> list[str]:
    """The targets that select no adaptable linear of ``spec``."""
    paths = adaptable(spec)
    return [t for t in targets if t != ALL_LINEAR and not any(p == t or p.endswith(f".{t}") for p in paths)]


def peft_config(lora, spec):
    """The ``peft.LoraConfig`` of a ``[lora]`` section, for ``spec``'s model."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=sorted({p.rpartition(".")[2] for p in targeted(spec, lora.targets)}),
        bias="none",
    )


def inject(stage, spec, lora, base_dtype=None) -> None:
    """Put peft's LoRA layers on the targeted linears of a stage (meta device): the base
    linears frozen (peft's ``requires_grad=False``), the adapters trainable. Only modules
    inside the blocks are adapted (never the head or the embedding). ``base_dtype``: what
    every frozen parameter is held in (bfloat16 halves the base's memory; the adapters and
    their optimizer state stay float32). With ``lora.dropout`` the adapters' dropout is
    models.lora_dropout's, which drops the same elements in every layout."""
    import torch
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(lora, spec), stage.get_submodule(spec.layers), adapter_name=ADAPTER)
    for module_name, module in stage.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            trained = is_adapter(f"{module_name}.{name}")  # norms, embedding, head: frozen too
            if not trained and base_dtype is not None and p.dtype != base_dtype:
                p = module._parameters[name] = torch.nn.Parameter(p.to(base_dtype))
            p.requires_grad_(trained)
    if lora.dropout:  # peft's nn.Dropout -> one whose mask every layout agrees on (models.lora_dropout)
        from raytrain_hybrid.models.lora_dropout import install

        install(stage, spec.layers, lora.dropout, ADAPTER)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str | None:
    """A stage parameter's name in the pretrained checkpoint (None: an adapter, not in it)."""
    if is_adapter(name):
        return None
    return name.replace(f"{_BASE}.", ".")


def adapter_init(name: str, shape, seed: int):
    """An adapter's full initial value, a function of (seed, name) only, so every layout
    agrees: peft's rule, A uniform in +-1/sqrt(in_features) (kaiming_uniform with a=sqrt(5)),
    B zeros (the adapted model starts as the pretrained one)."""
    import torch

    if ".lora_B." in name:
        return torch.zeros(shape)
    bound = 1 / math.sqrt(shape[1])
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def adapter_params(cfg) -> tuple[int, int]:
    """(adapter parameters per block, blocks) of ``cfg``'s model: r * (in + out) for every
    targeted linear, read off one block built on the meta device (no weights are read)."""
    import copy
    import dataclasses

    from raytrain_hybrid.models.common import build_stage
    from raytrain_hybrid.models.hub import Unreadable

    key = repr((cfg.model, cfg.lora))
    if key not in _COUNTS:
        spec = get_arch(cfg.model.arch)
        try:
            conf = copy.copy(spec.hf_config(cfg))
        except Unreadable:  # its config.json out of reach (`check` offline): the sizes the config gives
            sized = dataclasses.replace(cfg.model, pretrained="")
            conf = copy.copy(spec.hf_config(dataclasses.replace(cfg, model=sized)))
        conf.num_hidden_layers = 1
        stage = build_stage(spec, conf, [0], first=False, last=False)
        inject(stage, spec, cfg.lora)
        _COUNTS[key] = sum(p.numel() for n, p in stage.named_parameters() if is_adapter(n))
    return _COUNTS[key], get_arch(cfg.model.arch).num_blocks(cfg.model)


_COUNTS: dict[str, int] = {}  # the planner asks for the same model at every layout
