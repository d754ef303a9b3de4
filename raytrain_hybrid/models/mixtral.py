"""Mixtral: the MoE spec of qwen3_moe with transformers' Mixtral classes (no per-head q/k norms,
top-k routing weights renormalised, the experts' width is intermediate_size)."""

from raytrain_hybrid.models.qwen3_moe import moe_family_spec

SPEC = moe_family_spec("mixtral", "MixtralConfig", "MixtralForCausalLM", mixtral=True)
