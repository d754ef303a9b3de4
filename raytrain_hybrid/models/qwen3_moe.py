"""Qwen3-MoE: the unmodified transformers Qwen3MoeForCausalLM, driven stage by stage.

A mixture-of-experts model of the Llama family (``moe_family_spec``, Mixtral's too): the same
module tree, names and stage forward, with each block's MLP a sparse MoE block: a top-k router
(``mlp.gate``) and the experts as two 3D weights (``mlp.experts.gate_up_proj`` [E, 2F, H],
``mlp.experts.down_proj`` [E, H, F]), as transformers stores them. Attention keeps the dense TP
plan; the MoE block sees whole sequences and its weights are replicated over tp (expert
parallelism shards them over data-parallel ranks instead: distributed.expert_parallel).
"""

from __future__ import annotations

import dataclasses
import functools

from raytrain_hybrid.models.hf_checkpoint import checkpoint_config, is_set
from raytrain_hybrid.models.llama import family_spec
from raytrain_hybrid.models.spec import ArchSpec, TransformersClass


def _hf_config(config_cls, mixtral: bool, cfg):
    m = cfg.model
    if is_set(m.pretrained):
        return checkpoint_config(config_cls, m, attention_dropout=0.0, router_aux_loss_coef=m.router_aux_loss_coef)
    experts = (
        {"num_local_experts": m.num_experts, "router_jitter_noise": 0.0}
        if mixtral
        else {
            "num_experts": m.num_experts,
            "moe_intermediate_size": m.ffn_hidden_size,
            "norm_topk_prob": True,  # as Qwen3-MoE checkpoints route (Qwen3-30B-A3B)
            "head_dim": m.hidden_size // m.num_heads,
        }
    )
    return config_cls(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.seq_len,
        num_experts_per_tok=m.experts_per_token,
        router_aux_loss_coef=m.router_aux_loss_coef,
        tie_word_embeddings=False,  # embedding and head live on different pipeline stages
        attn_implementation="sdpa",
        use_cache=False,
        **experts,
    )


def _attention(m) -> int:
    h = m.hidden_size
    kv = m.num_kv_heads * (h // m.num_heads)
    return 2 * h * h + 2 * h * kv


def expert_params(m) -> int:
    """One expert's weights (a gated MLP: gate, up, down)."""
    return 3 * m.hidden_size * m.ffn_hidden_size


def _param_parts(qk_norm: bool, m) -> tuple[int, int, int]:
    h, v = m.hidden_size, m.vocab_size
    # attention, every expert, the router, 2 RMSNorms (+ Qwen3's per-head q/k norms)
    per_layer = _attention(m) + m.num_experts * expert_params(m) + m.num_experts * h + 2 * h
    per_layer += 2 * (h // m.num_heads) * qk_norm
    return per_layer, v * h, h + v * h


def matmul_params(m) -> int:
    """The weights one token meets: attention, the router, and its top-k experts only."""
    per_layer = _attention(m) + m.num_experts * m.hidden_size + m.experts_per_token * expert_params(m)
    return m.num_layers * per_layer + m.vocab_size * m.hidden_size


def moe_family_spec(name: str, config_class: str, model_class: str, *, mixtral: bool = False) -> ArchSpec:
    """The spec of a Llama-family mixture of experts with its own transformers classes."""
    dense = family_spec(name, config_class, model_class)
    attention = {k: v for k, v in dense.tp_plan.items() if k.startswith("self_attn.")}
    if not mixtral:  # Qwen3's per-head norms of queries and keys see this rank's heads
        attention |= {"self_attn.q_norm": "headnorm", "self_attn.k_norm": "headnorm"}
    return dataclasses.replace(
        dense,
        hf_config=functools.partial(_hf_config, TransformersClass(config_class), mixtral),
        # Pretrained MoE checkpoints store each expert's matrices apart: not read yet.
        hf_class=None,
        hf_model_types=(),
        sizes_from_hf=None,
        from_hf=None,
        param_parts=functools.partial(_param_parts, not mixtral),
        matmul_params=matmul_params,
        tp_plan=attention,
        # The MoE block routes whole sequences: its input is gathered from the sequence shards and
        # its output sliced back to them ("moe"); without SP it sees the full activations anyway.
        sp_plan={**dense.sp_plan, "mlp": "moe"},
        moe={"router": "mlp.gate", "experts": "mlp.experts"},
        expert_params=lambda m: m.num_experts * expert_params(m),
    )


SPEC = moe_family_spec("qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM")
