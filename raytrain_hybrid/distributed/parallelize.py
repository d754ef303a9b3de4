"""Turn one meta-device stage into its parallel form, in a fixed order:
TP (+SP) -> activation checkpointing -> FSDP2 (then materialise; zero=1 wraps nothing)."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from raytrain_hybrid.distributed.data_parallel import apply_fsdp
from raytrain_hybrid.distributed.parallel_dims import ParallelDims
from raytrain_hybrid.distributed.tensor_parallel import apply_tp
from raytrain_hybrid.models.spec import ArchSpec


def apply_activation_checkpointing(stage, spec: ArchSpec) -> None:
    """Recompute every block in backward; FQNs gain a wrapper prefix that the
    distributed state-dict helpers strip, so checkpoints keep the plain names."""
    blocks = stage.get_submodule(spec.layers)
    for key in list(blocks.keys()):
        blocks[key] = checkpoint_wrapper(blocks[key], preserve_rng_state=False)


def parallelize_stage(
    stage, spec: ArchSpec, mesh, dims: ParallelDims, *, activation_checkpointing: bool, sequence_parallel: bool
) -> None:
    if dims.tp > 1:
        apply_tp(stage, spec, mesh.tp, sequence_parallel=sequence_parallel)
    if activation_checkpointing:
        apply_activation_checkpointing(stage, spec)
    apply_fsdp(stage, spec, mesh, dims)
