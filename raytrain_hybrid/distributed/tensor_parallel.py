"""Apply an architecture's TP plan (DTensor) to every transformer block of a stage."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from raytrain_hybrid.models.spec import ArchSpec

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tp(stage, spec: ArchSpec, tp_mesh) -> None:
    """Column-wise in, row-wise out: one all-reduce per attention and per MLP, in forward and backward.

    Embeddings, norms and the head stay replicated: their inputs are full
    activations on every TP rank, so their gradients agree across the group.
    """
    tp = tp_mesh.size()
    for block in stage.get_submodule(spec.layers).values():
        parallelize_module(block, tp_mesh, {name: _STYLES[style]() for name, style in spec.tp_plan.items()})
        if spec.tp_adjust is not None:
            spec.tp_adjust(block, tp)
