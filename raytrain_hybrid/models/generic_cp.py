"""Context parallelism on the generic decoder path (models.generic): which families' attention the
engine's context-parallel attention (distributed.context_parallel: an all-to-all over heads, then
SDPA over the whole sequence with the family's mask) computes as transformers does, and where
each block's attention module is.

That attention replaces the family's attention function (transformers' ``AttentionInterface``),
so it honours what the family passes it (scaling, the mask its stage builds per layer type: causal,
sliding windows, packed documents) and nothing it would have added inside its own function. A family
is refused, with the reason, where its attention adds something SDPA does not (soft-capped scores,
sinks), where it is not multi-head attention over q/k/v projections (latent attention, linear
attention layers), or where transformers runs it eagerly only."""

from __future__ import annotations

import functools
import inspect

# The query (or fused query/key/value) projection of an attention module, by its name in transformers'
# TP plans; its parent module is the one that calls the attention function.
_QUERY = ("q_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_path(model_type: str) -> str | None:
    """The attention module's path inside a block, read off the family's TP plan; None where the
    plan names no query projection."""
    from raytrain_hybrid.models import generic

    layers = generic.pp_names(model_type)[1]
    inside = f"{layers}.*."
    for pattern in generic._tp_plan_raw(model_type):
        parts = pattern.removeprefix(inside).split(".")
        if pattern.startswith(inside) and len(parts) > 1 and parts[-1] in _QUERY:
            return ".".join(parts[:-1])
    return None


@functools.cache
def adds_sinks(model_type: str) -> bool:
    """Whether the family's modeling code gives its attention function sinks (gpt-oss's ``s_aux``):
    read in its source (recorded: models.generic_facts), as the config has no key for them."""
    from raytrain_hybrid.models import generic, generic_facts

    facts = generic_facts.recorded(model_type)
    if facts is not None:
        return facts["sinks"]
    source = inspect.getsource(inspect.getmodule(generic.classes(model_type)[1]))
    return "s_aux" in source or "sinks=" in source


def cp_refusal(model_type: str, hf_config) -> str | None:
    """Why context parallelism cannot run ``model_type`` (with this transformers config), in words;
    None: it can."""
    from raytrain_hybrid.models import generic

    if adds_sinks(model_type):
        return "adds attention sinks to its scores, which the context-parallel attention does not"
    other = sorted(set(getattr(hf_config, "layer_types", None) or ()) - set(_LAYER_TYPES))
    if attention_path(model_type) is None and not other:
        return "has no query/key/value projections in its tensor-parallel plan (latent or other attention)"
    if getattr(hf_config, "kv_lora_rank", None) or getattr(hf_config, "q_lora_rank", None):
        return (
            "has latent attention (compressed keys and values), which the context-parallel attention does not exchange"
        )
    if not generic.supports_sdpa(model_type) or hf_config._attn_implementation == "eager":
        return "runs only transformers' eager attention, which the context-parallel attention (SDPA) would replace"
    if getattr(hf_config, "attn_logit_softcapping", None):
        return "soft-caps its attention scores (attn_logit_softcapping), which the context-parallel attention does not"
    if other:  # (LFM2's short convolutions: a plan without q/k/v projections is not the reason)
        return f"has {', '.join(other)} layers, which attend other than through the attention the cp ranks exchange"
    return None
