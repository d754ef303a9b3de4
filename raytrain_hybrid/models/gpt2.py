"""GPT-2: transformers GPT2LMHeadModel with its Conv1D layers as nn.Linear.

GPT-2 stores projections as transposed ``Conv1D`` weights and fuses q, k and v in
one ``c_attn``; DTensor's column-wise style shards ``nn.Linear`` only, and a
contiguous split of the fused output would hand a rank all of q and half of k.
So the build swaps each Conv1D for an equivalent nn.Linear and ``c_attn`` for
three projections (same function, same initial values through ``to_hf``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models.hf_checkpoint import checkpoint_config, is_set
from raytrain_hybrid.models.packed import document_mask
from raytrain_hybrid.models.spec import ArchSpec

_CONV1D = ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class FusedQKV(nn.Module):
    """Stands in for ``c_attn``: q, k, v as separate projections, concatenated."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


def hf_config(cfg) -> GPT2Config:
    m = cfg.model
    if is_set(m.pretrained):  # the checkpoint's settings, without dropout (see below)
        return checkpoint_config(GPT2Config, m, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2Config(
        vocab_size=m.vocab_size,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_heads,
        n_inner=m.ffn_hidden_size,
        n_positions=m.seq_len,
        resid_pdrop=0.0,  # dropout would make layouts draw different random masks
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,  # embedding and head live on different pipeline stages
        attn_implementation="sdpa",
        use_cache=False,
        bos_token_id=0,  # the shipped tokenizer's end-of-text id (GPT-2's 50256 is outside small vocabularies)
        eos_token_id=0,
    )


def build(config: GPT2Config) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel(config)
    hidden = config.n_embd
    for block in model.transformer.h:
        block.attn.c_attn = FusedQKV(hidden)
        for path in _CONV1D:
            parent, name = path.split(".")
            conv = getattr(getattr(block, parent), name)
            assert isinstance(conv, Conv1D)
            in_features, out_features = conv.weight.shape
            setattr(getattr(block, parent), name, nn.Linear(in_features, out_features))
    return model


def tp_adjust(block, tp: int) -> None:
    # GPT2Attention splits the fused output in chunks of split_size; each rank now
    # holds hidden/tp of each of q, k and v.
    block.attn.split_size = block.attn.embed_dim // tp


def stage_forward(stage, x: torch.Tensor, position_ids: torch.Tensor | None = None):
    """``position_ids``: packed rows (data.packing), as for Llama (models.llama.stage_forward):
    the learned positions are looked up at each example's own, attention stays inside it."""
    tr = stage.transformer
    mask = None if position_ids is None else document_mask(position_ids)
    if tr.wte is not None:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0) if mask is None else position_ids
        h = tr.wte(x) + tr.wpe(positions)
    else:
        h = x
    for block in tr.h.values():
        h = block(h, attention_mask=mask)
    if tr.ln_f is not None:
        h = tr.ln_f(h)
    if stage.lm_head is not None:
        return stage.lm_head(h)
    return h if position_ids is None else (h, position_ids)


def to_hf(sd: dict) -> dict:
    """Project layout -> GPT2LMHeadModel layout (Conv1D weights are [in, out])."""
    out = {}
    for key, value in sd.items():
        if ".attn.c_attn." in key:
            prefix, rest = key.split(".attn.c_attn.")
            proj, kind = rest.split(".")
            if proj != "q_proj":
                continue
            parts = [sd[f"{prefix}.attn.c_attn.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")]
            if kind == "weight":
                out[f"{prefix}.attn.c_attn.weight"] = torch.cat([p.t() for p in parts], dim=1)
            else:
                out[f"{prefix}.attn.c_attn.bias"] = torch.cat(parts)
        elif any(f".{p}.weight" in key for p in _CONV1D):
            out[key] = value.t().contiguous()
        else:
            out[key] = value
    return out


def sizes_from_hf(conf: dict) -> dict:
    hidden = conf["n_embd"]
    return {
        "num_layers": conf["n_layer"],
        "hidden_size": hidden,
        "num_heads": conf["n_head"],
        "num_kv_heads": conf["n_head"],
        "ffn_hidden_size": conf.get("n_inner") or 4 * hidden,
        "vocab_size": conf["vocab_size"],
    }


def from_hf(name: str, conf: dict) -> tuple[tuple[str, ...], bool, tuple[int, ...]]:
    """Where an engine parameter lies in a GPT2LMHeadModel checkpoint: Conv1D weights are the
    transposes of our Linear ones; q, k, v are column blocks of c_attn (the inverse of to_hf)."""
    transposed, offset = False, ()
    if ".attn.c_attn." in name:
        prefix, rest = name.split(".attn.c_attn.")
        proj, kind = rest.split(".")
        block = ("q_proj", "k_proj", "v_proj").index(proj) * conf["n_embd"]
        name = f"{prefix}.attn.c_attn.{kind}"
        transposed, offset = (True, (0, block)) if kind == "weight" else (False, (block,))
    elif any(f".{p}.weight" in name for p in _CONV1D):
        transposed = True
    if name == "lm_head.weight":  # tied: the head starts from the token embedding
        return ("lm_head.weight", "transformer.wte.weight", "wte.weight"), False, ()
    # Checkpoints saved from GPT2Model (the original "gpt2") lack the "transformer." prefix.
    return (name, name.removeprefix("transformer.")), transposed, offset


def check(cfg) -> None:
    m = cfg.model
    if m.num_kv_heads != m.num_heads:
        raise ConfigError(
            "model.num_kv_heads", m.num_kv_heads, f"gpt2 has no grouped-query attention; use {m.num_heads}"
        )


def param_parts(m) -> tuple[int, int, int]:
    h, f, v = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+o with biases, mlp, 2 LayerNorms
    return per_layer, v * h + m.seq_len * h, 2 * h + v * h


def matmul_params(m) -> int:
    h = m.hidden_size
    return m.num_layers * (4 * h * h + 2 * h * m.ffn_hidden_size) + m.vocab_size * h  # blocks and the LM head


SPEC = ArchSpec(
    name="gpt2",
    hf_config=hf_config,
    build=build,
    hf_class=GPT2LMHeadModel,
    check=check,
    hf_model_types=("gpt2",),
    sizes_from_hf=sizes_from_hf,
    max_seq_len=lambda conf: conf.get("n_positions", 1024),
    from_hf=from_hf,
    param_parts=param_parts,
    matmul_params=matmul_params,
    layers="transformer.h",
    first_stage=("transformer.wte", "transformer.wpe"),
    last_stage=("transformer.ln_f", "lm_head"),
    tp_plan={
        "attn.c_attn.q_proj": "colwise",
        "attn.c_attn.k_proj": "colwise",
        "attn.c_attn.v_proj": "colwise",
        "attn.c_proj": "rowwise",
        "mlp.c_fc": "colwise",
        "mlp.c_proj": "rowwise",
    },
    tp_plan_outer={"transformer.wte": "embedding", "lm_head": "head"},
    sp_plan={"ln_1": "norm", "attn": "gather", "ln_2": "norm", "mlp": "gather"},
    # Position rows sharded like the sequence: each rank looks up and adds its own positions.
    sp_plan_outer={"transformer.wpe": "embedding", "transformer.ln_f": "norm"},
    tp_adjust=tp_adjust,
    stage_forward=stage_forward,
    to_hf=to_hf,
)
