"""Qwen2: the Llama spec with transformers' Qwen2 classes, whose q/k/v projections have biases."""

from raytrain_hybrid.models.llama import family_spec

SPEC = family_spec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", qkv_bias=True)
