"""Mistral: the Llama spec with transformers' Mistral classes (a sliding window in its config)."""

from raytrain_hybrid.models.llama import family_spec

SPEC = family_spec("mistral", "MistralConfig", "MistralForCausalLM")
