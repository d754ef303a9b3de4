"""Mistral: the Llama spec with transformers' Mistral classes (a sliding window in its config)."""

from transformers import MistralConfig, MistralForCausalLM

from raytrain_hybrid.models.llama import family_spec

SPEC = family_spec("mistral", MistralConfig, MistralForCausalLM)
