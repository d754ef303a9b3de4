"""Llama: the unmodified transformers LlamaForCausalLM, driven stage by stage.

The hand-written mixtures of experts (models.qwen3_moe: Qwen3-MoE, Mixtral) share its module tree,
names and forward through ``family_spec``, with their own transformers classes; a sliding window in
their config is refused past model.seq_len, as this forward attends over the whole causal window.
Every other Llama-like family (Mistral, Qwen2, Qwen3, ...) is trained by models.generic.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from raytrain_hybrid.models.hf_checkpoint import checkpoint_config, is_set
from raytrain_hybrid.models.packed import document_mask
from raytrain_hybrid.models.spec import ArchSpec, TransformersClass

if TYPE_CHECKING:  # imported where a model runs: the spec itself is data (see TransformersClass)
    import torch


def head_dim(m) -> int:
    """Width of one attention head: model.head_dim, or hidden_size / num_heads (0 picks)."""
    return m.head_dim or m.hidden_size // m.num_heads


def config_kwargs(m) -> dict:
    """The transformers config keywords of a Llama-family model built from model.* sizes (no
    checkpoint); a variant adds its own (the MoE specs: their experts)."""
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": head_dim(m),
        "max_position_embeddings": m.seq_len,
        "tie_word_embeddings": False,  # embedding and head live on different pipeline stages
        "attn_implementation": "sdpa",  # causal without a mask tensor
        "use_cache": False,
    }


def _hf_config(config_cls, cfg):
    m = cfg.model
    if is_set(m.pretrained):  # every setting from the checkpoint (RoPE scaling, eps, theta, ...)
        return checkpoint_config(config_cls, m, attention_dropout=0.0)
    return config_cls(**config_kwargs(m))


def stage_forward(stage, x: torch.Tensor, position_ids: torch.Tensor | None = None):
    """``position_ids`` (packed rows, data.packing): [rows, seq] per-example positions, which
    restart at 0 where an example begins; attention stays inside each example. They pass on
    to the next stage beside the hidden states: a middle stage returns (hidden, position_ids)."""
    import torch  # here, not with the spec (see TransformersClass); a dict lookup per call

    inner = stage.model
    first = inner.embed_tokens is not None
    h = inner.embed_tokens(x) if first else x
    mask = None  # causal over the whole row
    if position_ids is not None:
        positions, mask = position_ids, document_mask(position_ids)
    else:
        # Hidden states between stages may hold 1/seq_shards of the sequence (sequence parallelism).
        seq = x.shape[1] if first else x.shape[1] * getattr(stage, "seq_shards", 1)
        # Under context parallelism the stage runs on chunk ``seq_chunk`` of the sequence: its positions.
        start = seq * getattr(stage, "seq_chunk", 0)
        positions = torch.arange(start, start + seq, device=h.device).unsqueeze(0)
    rope = inner.rotary_emb(h, positions)
    for block in inner.layers.values():
        h = block(h, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    if inner.norm is not None:
        h = inner.norm(h)
    if stage.lm_head is not None:
        return stage.lm_head(h)
    return h if position_ids is None else (h, position_ids)


def init_buffers(stage, config, device: torch.device) -> None:
    # inv_freq is a non-persistent buffer: not in any state dict, garbage after to_empty().
    stage.model.rotary_emb = type(stage.model.rotary_emb)(config).to(device)


def sizes_from_hf(conf: dict) -> dict:
    heads = conf["num_attention_heads"]
    return {
        "num_layers": conf["num_hidden_layers"],
        "hidden_size": conf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": conf.get("num_key_value_heads") or heads,
        "head_dim": conf.get("head_dim") or conf["hidden_size"] // heads,
        "ffn_hidden_size": conf["intermediate_size"],
        "vocab_size": conf["vocab_size"],
    }


def max_seq_len(conf: dict) -> int:
    limit = conf.get("max_position_embeddings") or 0
    # Mixtral slides whenever sliding_window is set; Qwen3-MoE only with use_sliding_window.
    window = (
        conf.get("sliding_window") if conf.get("use_sliding_window", conf.get("model_type") != "qwen3_moe") else None
    )
    return min(limit, window) if window and limit else (window or limit)


def from_hf(name: str, conf: dict) -> tuple[tuple[str, ...], bool, tuple[int, ...]]:
    # Same names; a tied checkpoint has no lm_head.weight: the head starts from the embedding.
    if name == "lm_head.weight":
        return ("lm_head.weight", "model.embed_tokens.weight"), False, ()
    return (name,), False, ()


def default_ffn(hidden: int) -> int:
    # 8/3 of the width, rounded up to 32: the gated MLP's three matrices hold what a 4x MLP's two do.
    return 32 * ((8 * hidden // 3 + 31) // 32)


def param_parts(m) -> tuple[int, int, int]:
    h, f, v = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    per_layer = attention_params(m) + 3 * h * f + 2 * h  # attention, gated MLP, 2 RMSNorms
    return per_layer, v * h, h + v * h


def attention_params(m) -> int:
    """q, o at the heads' width, k, v at the kv heads' (a head is head_dim wide, not always
    hidden_size / num_heads)."""
    return 2 * m.hidden_size * (m.num_heads + m.num_kv_heads) * head_dim(m)


def matmul_params(m) -> int:
    h, f = m.hidden_size, m.ffn_hidden_size
    # q, o at the heads' width; k, v at the kv heads'; the gated MLP has three matrices.
    per_layer = attention_params(m) + 3 * h * f
    return m.num_layers * per_layer + m.vocab_size * h  # the LM head is a matmul; the embedding lookup is not


def family_spec(name: str, config_class: str, model_class: str) -> ArchSpec:
    """The spec of a Llama-family architecture: Llama's, with its own transformers classes
    (named: imported when a model is built)."""
    config_cls, model_cls = TransformersClass(config_class), TransformersClass(model_class)
    return ArchSpec(
        name=name,
        hf_config=functools.partial(_hf_config, config_cls),
        build=model_cls,
        hf_class=model_cls,
        hf_model_types=(name,),
        sizes_from_hf=sizes_from_hf,
        max_seq_len=max_seq_len,
        from_hf=from_hf,
        default_ffn=default_ffn,
        param_parts=param_parts,
        matmul_params=matmul_params,
        layers="model.layers",
        first_stage=("model.embed_tokens",),
        last_stage=("model.norm", "lm_head"),
        tp_plan={
            "self_attn.q_proj": "colwise",
            "self_attn.k_proj": "colwise",
            "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        },
        tp_plan_outer={"model.embed_tokens": "embedding", "lm_head": "head"},
        sp_plan={
            "input_layernorm": "norm",
            "self_attn": "gather:hidden_states",
            "post_attention_layernorm": "norm",
            "mlp": "gather",
        },
        sp_plan_outer={"model.norm": "norm"},
        stage_forward=stage_forward,
        init_buffers=init_buffers,
        attention="self_attn",
    )


SPEC = family_spec("llama", "LlamaConfig", "LlamaForCausalLM")
