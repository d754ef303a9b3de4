"""Apply an architecture's TP plan (DTensor) to a stage: its blocks, its embedding and head."""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from raytrain_hybrid.models.spec import ArchSpec

_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # Vocab-parallel embedding: each rank holds vocab/tp rows; the partial lookups are all-reduced.
    "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Vocab-parallel head: each rank computes vocab/tp logits; they are gathered for the loss.
    "head": lambda: ColwiseParallel(output_layouts=Replicate()),
}


def apply_tp(stage, spec: ArchSpec, tp_mesh) -> None:
    """Column-wise in, row-wise out: one all-reduce per attention and per MLP, in forward and backward.

    Norms (and GPT-2's position embedding) stay replicated: their inputs are full
    activations on every TP rank, so their gradients agree across the group.
    """
    tp = tp_mesh.size()
    for block in stage.get_submodule(spec.layers).values():
        parallelize_module(block, tp_mesh, {name: _STYLES[style]() for name, style in spec.tp_plan.items()})
        if spec.tp_adjust is not None:
            spec.tp_adjust(block, tp)
    outer = {}
    for path, style in spec.tp_plan_outer.items():
        parent, _, name = path.rpartition(".")
        if getattr(stage.get_submodule(parent) if parent else stage, name) is not None:  # owned by this stage
            outer[path] = _STYLES[style]()
    if outer:
        parallelize_module(stage, tp_mesh, outer)
