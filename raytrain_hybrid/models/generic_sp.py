"""Sequence parallelism on the generic decoder path (models.generic): each block's plan read off its
own modules, as TorchTitan writes Llama's by hand. Between the TP regions the residual stream holds
this rank's 1/tp of the sequence: the block's norms run on it (``seqnorm``: SequenceParallel, a plain
tensor out, as a post-norm's output meets the residual), every other child with weights (attention,
MLP) gathers its hidden states to the whole sequence first (``gather_hidden``), and its row-wise
output is reduce-scattered back to sequence shards (a child outside the TP plan's row-wise
projections keeps this rank's shard of its whole output instead). The final norm runs sharded too; the embedding's
output and the head's input are sharded on the sequence by their TP styles.

A family whose block holds weights of its own (a layer scale applied to the residual stream) would
see 1/tp of the tokens in them and is refused; so is one the model matrix found to differ from the
one-process reference at dp=1 x tp=2 with sequence parallelism (scripts/model_matrix.py --sp)."""

from __future__ import annotations


def block_plan(reduced: frozenset[str], block) -> dict[str, str]:
    """{child: style} of one decoder block. ``reduced``: the children whose output a row-wise
    projection of the TP plan reduces (onto sequence shards); any other child with weights (an
    attention or a mixture of experts outside the plan, a linear attention whose projections
    gather their outputs) runs whole on every rank and hands back this rank's shard (``whole``).
    Children without weights (dropouts, activations, a norm without a scale) run on whatever they
    are given: per token, so on the shard as well."""
    own = [name for name, _ in block.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(block).__name__} holds weights of its own ({', '.join(own)}) that sequence parallelism "
            "would apply to 1/tp of the tokens; set parallelism.sequence_parallel=false"
        )
    plan = {}
    for name, child in block.named_children():
        if next(child.parameters(), None) is None:
            continue
        if "norm" in type(child).__name__.lower():
            plan[name] = "seqnorm"
        else:
            plan[name] = "gather_hidden" if name in reduced else "whole"
    return plan


def refusal(model_type: str) -> str | None:
    """Why sequence parallelism does not apply to ``model_type`` (None: it does): the model
    matrix's verdict where it has one."""
    from raytrain_hybrid.models import generic

    row = generic.verified().get(model_type) or {}
    if row.get("sp") is False:
        return row.get("sp_reason") or "differs from the reference with sequence parallelism"
    return None


def reduced_children(tp_plan: dict[str, str]) -> frozenset[str]:
    """The block children whose output a row-wise projection reduces (block TP plan: path -> style)."""
    return frozenset(path.split(".")[0] for path, style in tp_plan.items() if style in ("rowwise", "rowwise_split"))
