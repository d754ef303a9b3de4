"""Parameter counts of a model as built, per block and per pipeline end, from its config alone."""

from __future__ import annotations

from raytrain_hybrid.models import get_arch


def has_sequence_parallel(model) -> bool:
    """Whether the architecture has a sequence-parallel plan (BERT's post-LN blocks do not; a generic
    family the model matrix refused it)."""
    return get_arch(model.arch).sequence_parallel


def sequence_parallel_line(cfg) -> str | None:
    """Whether a run at tp > 1 shards its norms and residual stream along the sequence, and if not,
    why, in the words `check` prints (None at tp = 1: nothing to split)."""
    par, arch = cfg.parallelism, cfg.model.arch
    if par.tp == 1:
        return None
    if not par.sequence_parallel:
        return "sequence parallelism: off (parallelism.sequence_parallel=false)"
    if has_sequence_parallel(cfg.model):
        return f"sequence parallelism: on (norms and the residual stream split over tp={par.tp})"
    from raytrain_hybrid.models import ARCH_NAMES, generic_sp

    why = None if arch in ARCH_NAMES else generic_sp.refusal(arch)
    return f"sequence parallelism: not applied: {arch} {why or 'has no sequence-parallel plan'}; tp runs without it"


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
