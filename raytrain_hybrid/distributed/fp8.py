"""FP8 training (``train.fp8``): the transformer blocks' linears become torchao's ``Float8Linear``
(TorchTitan's float8 converter): their matmuls run in float8 with dynamic scales (one per tensor,
or one per row with "rowwise"), while the weights, gradients and optimizer state stay in the
run's dtype. The weights keep their names and dtype, so checkpoints, resume and export are those
of a bf16/fp32 run.

Left in high precision: the output head and embedding (outside the blocks; TorchTitan leaves the
head too), and any linear whose dimensions are not multiples of 16 (``torch._scaled_mm`` refuses
them). ``train.fp8_emulate`` runs the same casts with float32 matmuls on any device: slower than
bf16, for holding the plumbing on a CPU, never for speed."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models.spec import ArchSpec

RECIPES = ("off", "rowwise", "tensorwise")
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer: the first GPUs with float8 tensor cores


def _why_left(name: str, mod: nn.Module, blocks: str) -> str | None:
    """None when the linear ``name`` converts, else why it stays in high precision."""
    if not name.startswith(f"{blocks}."):
        return "outside the transformer blocks"
    if mod.in_features % 16 or mod.out_features % 16:
        return f"dimensions {mod.in_features}x{mod.out_features} are not multiples of 16"
    return None


def plan_fp8(stage: nn.Module, spec: ArchSpec) -> tuple[list[str], dict[str, str]]:
    """(the linears that convert, {linear left in high precision: why}), by module name."""
    converted, left = [], {}
    for name, mod in stage.named_modules():
        if type(mod) is not nn.Linear:  # (a LoRA run's peft layers are refused before this)
            continue
        why = _why_left(name, mod, spec.layers)
        if why is None:
            converted.append(name)
        else:
            left[name] = why
    return converted, left


def fp8_config(recipe: str, emulate: bool):
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


def apply_fp8(stage: nn.Module, spec: ArchSpec, recipe: str, emulate: bool) -> None:
    """Swap the convertible linears of a meta-device stage for Float8Linear, before TP, FSDP and
    compile wrap them (the order TorchTitan applies its converters in)."""
    from torchao.float8 import convert_to_float8_training

    converted = set(plan_fp8(stage, spec)[0])
    convert_to_float8_training(
        stage, config=fp8_config(recipe, emulate), module_filter_fn=lambda mod, fqn: fqn in converted
    )


def require_fp8_device(recipe: str, emulate: bool, device: torch.device) -> None:
    """Refuse train.fp8 on a device without float8 matmuls (unless emulated)."""
    if recipe == "off" or emulate:
        return
    if device.type != "cuda":
        raise ConfigError(
            "train.fp8",
            recipe,
            f"needs an NVIDIA GPU of compute capability >= 8.9 (H100, L4, B200); this run is on {device.type}. "
            'Use train.fp8="off", or train.fp8_emulate=true to check the setup (emulated casts, no speed-up)',
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            "train.fp8",
            recipe,
            f"needs compute capability >= 8.9 (H100, L4, B200); {torch.cuda.get_device_name(device)} has "
            f'{capability[0]}.{capability[1]}. Use train.fp8="off" (bf16: train.dtype="bfloat16")',
        )


def describe_fp8(cfg) -> str:
    """What `check` says of train.fp8: the linears converted in one block, and those left out."""
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    spec = get_arch(cfg.model.arch)
    stage = build_stage(spec, spec.hf_config(cfg), [0], first=True, last=True)
    converted, left = plan_fp8(stage, spec)
    block = f"{spec.layers}.0."
    names = [n.removeprefix(block) for n in converted]
    mode = " (emulated)" if cfg.train.fp8_emulate else ""
    lines = [f"fp8 {cfg.train.fp8}{mode}: {len(names)} linears a block in float8 ({', '.join(names) or 'none'})"]
    for name, why in left.items():
        lines.append(f"  {name.replace(block, f'{spec.layers}.N.')} stays in {cfg.train.dtype}: {why}")
    return "\n".join(lines)
