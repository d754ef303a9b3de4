"""The oracle's reference for mixtures of experts: transformers' own Qwen3MoeForCausalLM and
MixtralForCausalLM in one process, nothing computed by raytrain_hybrid.

The model is built from the config's values here (eager attention and transformers' eager loop
over experts: the engine runs sdpa and grouped_mm, a second implementation of each). The loss is
the next-token cross-entropy plus model.router_aux_loss_coef times transformers' own
``load_balancing_loss_func`` applied to each sequence's router logits of each MoE layer (the
model's ``output_router_logits``), averaged over sequences and layers: the definition the engine
documents (engine.loss.RouterLoss), which every layout can compute where its tokens are. The
training loop, AdamW and the schedule are tests/reference.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from reference import _engine_initial, _train, memory_windows


def moe_model(cfg):
    import transformers

    m = cfg.model
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim or m.hidden_size // m.num_heads,
        max_position_embeddings=m.seq_len,
        num_experts_per_tok=m.experts_per_token,
        router_aux_loss_coef=m.router_aux_loss_coef,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    if m.arch == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=m.num_experts, router_jitter_noise=0.0, **common)
        return transformers.MixtralForCausalLM(config), transformers.models.mixtral.modeling_mixtral
    assert m.arch == "qwen3-moe", m.arch
    config = transformers.Qwen3MoeConfig(
        num_experts=m.num_experts,
        moe_intermediate_size=m.ffn_hidden_size,
        norm_topk_prob=True,
        **common,
    )
    return transformers.Qwen3MoeForCausalLM(config), transformers.models.qwen3_moe.modeling_qwen3_moe


def sequence_aux_loss(router_logits: tuple, seq_len: int, experts: int, top_k: int, balance) -> torch.Tensor:
    """The mean over layers and sequences of transformers' ``balance`` (load_balancing_loss_func)
    on one layer's logits of one sequence."""
    terms = [
        balance((layer[start : start + seq_len],), experts, top_k)
        for layer in router_logits
        for start in range(0, layer.shape[0], seq_len)
    ]
    return torch.stack(terms).mean()


def moe_reference_run(cfg, initial=None) -> list[dict]:
    torch.manual_seed(0)
    model, modeling = moe_model(cfg)
    start = _engine_initial(cfg, initial)
    model.load_state_dict(start, strict=True)
    windows = memory_windows(cfg, cfg.train.steps)
    m, weighted = cfg.model, []  # (each step's weighted auxiliary loss, for the run's router_aux_loss)

    def loss_of(model, step):
        inputs, labels = windows[step][:, :-1], windows[step][:, 1:]
        out = model(input_ids=inputs, output_router_logits=True)
        lm = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
        balance = modeling.load_balancing_loss_func
        aux = sequence_aux_loss(out.router_logits, m.seq_len, m.num_experts, m.experts_per_token, balance)
        weighted.append(m.router_aux_loss_coef * aux.item())
        return lm + m.router_aux_loss_coef * aux

    out = _train(cfg, model, dict, loss_of)
    for step, value in zip(out, weighted, strict=True):
        step["router_aux_loss"] = value
    out[0]["initial"] = start
    return out
