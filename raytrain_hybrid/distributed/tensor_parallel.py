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


def align_grad_placements(module) -> None:
    """Keep each TP parameter's gradient sharded like the parameter.

    DTensor's rule for the embedding backward computes the vocab-parallel
    embedding's gradient as Replicate: every rank would hold the full
    vocab x hidden gradient. Re-sharding it is a local slice (no communication).
    FSDP2 does this itself when it reduce-scatters, so this is for stages without it.
    """
    from torch.distributed.tensor import DTensor

    def hook(param) -> None:
        if param.grad is not None and param.grad.placements != param.placements:
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)

    for param in module.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(hook)
