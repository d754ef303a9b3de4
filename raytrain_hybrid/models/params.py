"""Parameter counts of a model as built, per block and per pipeline end, from its config alone."""

from __future__ import annotations


def has_sequence_parallel(model) -> bool:
    """Whether the architecture has a sequence-parallel plan (BERT's post-LN blocks do not)."""
    from raytrain_hybrid.models import get_arch

    return bool(get_arch(model.arch).sp_plan)


def num_blocks(model) -> int:
    from raytrain_hybrid.models import get_arch

    return get_arch(model.arch).num_blocks(model)


def bert_embedding_params(model) -> int:
    """One BERT encoder's embeddings: words, 512 positions, 2 token types, LayerNorm."""
    h = model.hidden_size
    return model.vocab_size * h + max(512, model.seq_len) * h + 2 * h + 2 * h


def param_parts(model) -> tuple[int, int, int]:
    """(per block, first stage extra: embeddings, last stage extra: final norm + head).
    multimodal-bert: the first stage's extra is encoder A's embeddings and the tabular
    network; encoder B's embeddings sit with its first block (max_rank_params)."""
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    if model.arch == "multimodal-bert":
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # BERT block: like GPT-2's
        th, fh = model.tabular_hidden_size, model.fusion_hidden_size
        tabular = 3 * th + th + th * th + th  # three features is the shipped set's width
        head = (2 * h + th) * fh + fh + fh * model.num_classes + model.num_classes
        return per_layer, bert_embedding_params(model) + tabular, head
    if model.arch == "gpt2":
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+o with biases, mlp, 2 LayerNorms
        return per_layer, v * h + model.seq_len * h, 2 * h + v * h
    kv = model.num_kv_heads * (h // model.num_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # attention, gated MLP, 2 RMSNorms
    return per_layer, v * h, h + v * h


def param_count(model) -> int:
    """All parameters of the model as built (untied embedding and head)."""
    per_layer, first, last = param_parts(model)
    second = bert_embedding_params(model) if model.arch == "multimodal-bert" else 0
    return num_blocks(model) * per_layer + first + last + second
