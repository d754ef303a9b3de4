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
from raytrain_hybrid.models.llama import attention_params, config_kwargs, family_spec, head_dim
from raytrain_hybrid.models.llama import from_hf as llama_from_hf
from raytrain_hybrid.models.llama import sizes_from_hf as llama_sizes
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
        }
    )
    return config_cls(
        **config_kwargs(m),
        num_experts_per_tok=m.experts_per_token,
        router_aux_loss_coef=m.router_aux_loss_coef,
        **experts,
    )


def expert_params(m) -> int:
    """One expert's weights (a gated MLP: gate, up, down)."""
    return 3 * m.hidden_size * m.ffn_hidden_size


def _param_parts(qk_norm: bool, m) -> tuple[int, int, int]:
    h, v = m.hidden_size, m.vocab_size
    # attention, every expert, the router, 2 RMSNorms (+ Qwen3's per-head q/k norms)
    per_layer = attention_params(m) + m.num_experts * expert_params(m) + m.num_experts * h + 2 * h
    per_layer += 2 * head_dim(m) * qk_norm
    return per_layer, v * h, h + v * h


def matmul_params(m) -> int:
    """The weights one token meets: attention, the router, and its top-k experts only."""
    per_layer = attention_params(m) + m.num_experts * m.hidden_size + m.experts_per_token * expert_params(m)
    return m.num_layers * per_layer + m.vocab_size * m.hidden_size


def _experts(mixtral: bool, conf: dict) -> tuple[int, int]:
    """(experts, an expert's width) of a config.json (transformers writes num_local_experts for
    both; Qwen's own files say num_experts)."""
    experts = conf.get("num_local_experts") or conf["num_experts"]
    return experts, conf["intermediate_size"] if mixtral else conf["moe_intermediate_size"]


def sizes_from_hf(mixtral: bool, conf: dict) -> dict:
    sizes = llama_sizes(conf)
    experts, width = _experts(mixtral, conf)
    return {**sizes, "ffn_hidden_size": width, "num_experts": experts, "experts_per_token": conf["num_experts_per_tok"]}


# A checkpoint keeps each expert's projections apart: (prefix of the MoE block, names of gate, up, down).
_CHECKPOINT_EXPERTS = {
    False: ("mlp", "gate_proj", "up_proj", "down_proj"),
    True: ("block_sparse_moe", "w1", "w3", "w2"),
}


def from_hf(mixtral: bool, name: str, conf: dict):
    """Where an engine parameter lies in a Hugging Face checkpoint: the experts' stacked weights
    as one tensor per expert and projection (gate and up stacked in gate_up_proj), the router
    under Mixtral's block_sparse_moe; everything else under its own name."""
    block, gate, up, down = _CHECKPOINT_EXPERTS[mixtral]
    layer, _, rest = name.partition(".mlp.")
    if not rest:
        return llama_from_hf(name, conf)
    if rest == "gate.weight":
        return (f"{layer}.{block}.gate.weight",), False, ()
    experts, width = _experts(mixtral, conf)
    key = f"{layer}.{block}.experts.{{}}.{{}}.weight"
    if rest == "experts.down_proj":
        return [(key.format(e, down), (e,)) for e in range(experts)]
    assert rest == "experts.gate_up_proj", name
    halves = ((gate, slice(0, width)), (up, slice(width, 2 * width)))
    return [(key.format(e, proj), (e, rows)) for e in range(experts) for proj, rows in halves]


def moe_family_spec(name: str, config_class: str, model_class: str, *, mixtral: bool = False) -> ArchSpec:
    """The spec of a Llama-family mixture of experts with its own transformers classes."""
    dense = family_spec(name, config_class, model_class)
    attention = {k: v for k, v in dense.tp_plan.items() if k.startswith("self_attn.")}
    if not mixtral:  # Qwen3's per-head norms of queries and keys see this rank's heads
        attention |= {"self_attn.q_norm": "headnorm", "self_attn.k_norm": "headnorm"}
    return dataclasses.replace(
        dense,
        hf_config=functools.partial(_hf_config, TransformersClass(config_class), mixtral),
        hf_model_types=("mixtral",) if mixtral else ("qwen3_moe",),
        sizes_from_hf=functools.partial(sizes_from_hf, mixtral),
        from_hf=functools.partial(from_hf, mixtral),
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
