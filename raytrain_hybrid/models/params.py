"""Parameter counts of a model as built, per block and per pipeline end, from its config alone."""

from __future__ import annotations

from raytrain_hybrid.models import get_arch


def has_sequence_parallel(model) -> bool:
    """Whether the architecture has a sequence-parallel plan (BERT's post-LN blocks do not)."""
    return bool(get_arch(model.arch).sp_plan)


def num_blocks(model) -> int:
    return get_arch(model.arch).num_blocks(model)


def param_parts(model) -> tuple[int, int, int]:
    """(per block, first stage extra: embeddings, last stage extra: final norm + head)."""
    return get_arch(model.arch).param_parts(model)


def anchored_params(model) -> dict[int, int]:
    """{block: parameters that live with that block beyond its own}."""
    return get_arch(model.arch).anchored_params(model)


def param_count(model) -> int:
    """All parameters of the model as built (untied embedding and head)."""
    per_layer, first, last = param_parts(model)
    return num_blocks(model) * per_layer + first + last + sum(anchored_params(model).values())
