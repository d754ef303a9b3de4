"""The ``[lora]`` section: low-rank adapters on a pretrained language model's linears.
Checks across keys (model.pretrained, the architecture's linears) are config.validate's."""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_hybrid.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    # Rank r of the adapters (0: LoRA off, every parameter trained). With r > 0 each targeted
    # linear W of a pretrained model (model.pretrained) trains W + (alpha / r) * B @ A, B of
    # [out, r] and A of [r, in], while W and every other pretrained weight stay frozen: no
    # gradients and no optimizer state for them. 8 or 16 are usual.
    rank: int = 0
    # The adapters' scale numerator: their output is multiplied by alpha / rank.
    alpha: float = 16.0
    # Dropout on the adapters' input (0: none), in [0, 1). Every layout drops the same elements (a
    # mask by seed, linear, step and the element's place in the global batch), so a run with dropout
    # trains the same model whatever its dp, cp, tp and pp.
    dropout: float = 0.0
    # The linears adapted in every block, by module name (q_proj, k_proj, v_proj, o_proj,
    # gate_proj, up_proj, down_proj for the Llama family), or "all-linear" for all of them.
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError("lora.rank", self.rank, "must be >= 0 (0: LoRA off; 8 or 16 are usual)")
        if self.alpha <= 0:
            raise ConfigError("lora.alpha", self.alpha, "must be > 0 (the adapters' output is scaled by alpha/rank)")
        if not 0 <= self.dropout < 1:
            raise ConfigError("lora.dropout", self.dropout, "must be in [0, 1) (0: no dropout)")
        if self.rank and not self.targets:
            raise ConfigError(
                "lora.targets", self.targets, 'names no module; give e.g. ["q_proj", "v_proj"] or "all-linear"'
            )


def check_lora(cfg, spec) -> None:
    """LoRA across keys: a pretrained language model to adapt, and targets among its linears."""
    from raytrain_hybrid.models.hf_checkpoint import is_set
    from raytrain_hybrid.models.lora import ALL_LINEAR, target_names, unmatched

    lora = cfg.lora
    if not lora.rank:
        return
    if not is_set(cfg.model.pretrained) or spec.from_hf is None:
        raise ConfigError(
            "lora.rank",
            lora.rank,
            "adapts a pretrained model, and model.pretrained names none; set model.pretrained to a Hugging Face "
            "checkpoint (a directory, a storage URI or a Hub id), or lora.rank=0 to train every weight",
        )
    if spec.moe is not None:  # runs, but no oracle holds it to peft yet: refused until one does
        raise ConfigError(
            "lora.rank",
            lora.rank,
            f"LoRA on a mixture of experts (model.arch={cfg.model.arch}) is not supported yet; use lora.rank=0 "
            "for a full fine-tune of it, or LoRA on a dense model (llama, qwen3, mistral, ...: docs/models.md)",
        )
    names = target_names(spec)
    if not names:
        raise ConfigError(
            "lora.rank",
            lora.rank,
            f"model.arch={cfg.model.arch} holds no linear as its transformers model does (fused or transposed "
            "weights); use a Llama-family model or lora.rank=0",
        )
    missing = unmatched(spec, lora.targets)
    if missing:
        raise ConfigError(
            "lora.targets",
            lora.targets,
            f"{', '.join(map(repr, missing))} matches no linear of the {cfg.model.arch} blocks; "
            f"use some of {', '.join(names)}, or {ALL_LINEAR!r}",
        )
