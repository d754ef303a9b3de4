"""Llama: the unmodified transformers LlamaForCausalLM, driven stage by stage."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from raytrain_hybrid.models.spec import ArchSpec


def hf_config(cfg) -> LlamaConfig:
    m = cfg.model
    return LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.seq_len,
        tie_word_embeddings=False,  # embedding and head live on different pipeline stages
        attn_implementation="sdpa",  # causal without a mask tensor
        use_cache=False,
    )


def stage_forward(stage, x: torch.Tensor) -> torch.Tensor:
    inner = stage.model
    first = inner.embed_tokens is not None
    h = inner.embed_tokens(x) if first else x
    # Hidden states between stages may hold 1/seq_shards of the sequence (sequence parallelism).
    seq = x.shape[1] if first else x.shape[1] * getattr(stage, "seq_shards", 1)
    positions = torch.arange(seq, device=h.device).unsqueeze(0)
    rope = inner.rotary_emb(h, positions)
    for block in inner.layers.values():
        h = block(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
    if inner.norm is not None:
        h = inner.norm(h)
    if stage.lm_head is not None:
        h = stage.lm_head(h)
    return h


def init_buffers(stage, config: LlamaConfig, device: torch.device) -> None:
    # inv_freq is a non-persistent buffer: not in any state dict, garbage after to_empty().
    stage.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)


def default_ffn(hidden: int) -> int:
    # 8/3 of the width, rounded up to 32: the gated MLP's three matrices hold what a 4x MLP's two do.
    return 32 * ((8 * hidden // 3 + 31) // 32)


def param_parts(m) -> tuple[int, int, int]:
    h, f, v = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    kv = m.num_kv_heads * (h // m.num_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # attention, gated MLP, 2 RMSNorms
    return per_layer, v * h, h + v * h


def matmul_params(m) -> int:
    h, f = m.hidden_size, m.ffn_hidden_size
    # q, o full width; k, v at kv-head width; the gated MLP has three matrices.
    per_layer = 2 * h * h + 2 * h * m.num_kv_heads * (h // m.num_heads) + 3 * h * f
    return m.num_layers * per_layer + m.vocab_size * h  # the LM head is a matmul; the embedding lookup is not


SPEC = ArchSpec(
    name="llama",
    hf_config=hf_config,
    build=LlamaForCausalLM,
    hf_class=LlamaForCausalLM,
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
)
