"""Turn one meta-device stage into its parallel form, in a fixed order (TorchTitan's):
FP8 linears -> TP (+SP) -> CP -> activation checkpointing -> compile -> FSDP2 (then materialise;
zero=1 wraps nothing)."""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from raytrain_hybrid.distributed.context_parallel import apply_cp
from raytrain_hybrid.distributed.data_parallel import apply_fsdp
from raytrain_hybrid.distributed.expert_parallel import apply_ep
from raytrain_hybrid.distributed.fp8 import apply_fp8
from raytrain_hybrid.distributed.parallel_dims import ParallelDims
from raytrain_hybrid.distributed.tensor_parallel import apply_tp
from raytrain_hybrid.models.spec import ArchSpec


def _saved_ops() -> frozenset:
    """What selective checkpointing keeps: the outputs of matmuls and of attention (every SDPA
    kernel: flash, efficient, cuDNN, the CPU one), whose recomputation costs the FLOPs of the
    forward again; and of TP collectives, whose recomputation would repeat the communication
    (TorchTitan keeps those too). Everything else (norms, RoPE, SiLU, residual adds, casts) is
    cheap element-wise work, recomputed in backward instead of held."""
    aten, funcol = torch.ops.aten, torch.ops._c10d_functional
    names = [n for n in dir(aten) if n.startswith("_scaled_dot_product_") and not n.endswith("_backward")]
    ops = [aten.mm.default, aten.addmm.default, aten.bmm.default, *(getattr(aten, n).default for n in names)]
    ops += [funcol.all_reduce.default, funcol.reduce_scatter_tensor.default, funcol.all_gather_into_tensor.default]
    return frozenset(ops)


def _selective_policy(saved: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # MUST_SAVE: torch.compile's partitioner may not drop these; PREFER_RECOMPUTE leaves it free
    # to keep an element-wise output it finds cheaper to store (as TorchTitan's policy does).
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(stage, spec: ArchSpec, mode: bool | str = True) -> None:
    """Recompute every block in backward (mode True), or only its element-wise ops ("selective").
    FQNs gain a wrapper prefix that the distributed state-dict helpers strip, so checkpoints keep
    the plain names."""
    kwargs = {}
    if mode == "selective":
        policy = functools.partial(_selective_policy, _saved_ops())
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    blocks = stage.get_submodule(spec.layers)
    for key in list(blocks.keys()):
        blocks[key] = checkpoint_wrapper(blocks[key], preserve_rng_state=False, **kwargs)


def apply_compile(stage, spec: ArchSpec) -> None:
    """torch.compile each transformer block on its own (TorchTitan's choice): blocks share their
    code, so one graph serves all of a stage's blocks, and a graph break stays inside a block.
    The block's forward is compiled in place rather than wrapped (an OptimizedModule would add
    ``_orig_mod.`` to every parameter name); hooks on the block itself, FSDP2's all-gathers
    applied after this, run outside the compiled region, as they do around TorchTitan's."""
    for block in stage.get_submodule(spec.layers).values():
        block.forward = torch.compile(block.forward)
        block.register_forward_pre_hook(_own_input, with_kwargs=True)


def _own_input(block, args: tuple, kwargs: dict):
    """A block's hidden states that are a view of a tensor subclass become a tensor of their own.
    Under TP the embedding's output is ``to_local()`` of an async collective's result, a view
    whose base is an AsyncCollectiveTensor; AOTAutograd (torch 2.13) then hands the eager
    redistribution before it a plain-tensor gradient instead of a DTensor (''Tensor' object has
    no attribute '_local_tensor'' in backward). One copy, at a stage's first block only."""
    x = args[0] if args else None
    base = getattr(x, "_base", None)
    if base is not None and type(base) is not torch.Tensor:
        return (x.clone(), *args[1:]), kwargs
    return None


def parallelize_stage(
    stage,
    spec: ArchSpec,
    mesh,
    dims: ParallelDims,
    *,
    activation_checkpointing: bool | str,
    sequence_parallel: bool,
    compile: bool = False,
    fp8: str = "off",
    fp8_emulate: bool = False,
) -> None:
    if fp8 != "off":  # the module swap first: TP, FSDP2 and compile then wrap Float8Linear
        apply_fp8(stage, spec, fp8, fp8_emulate)
    if dims.tp > 1:
        apply_tp(stage, spec, mesh.tp, sequence_parallel=sequence_parallel)
    if dims.ep > 1:
        apply_ep(stage, spec, mesh, dims)
    if dims.cp > 1:
        apply_cp(stage, spec, mesh.cp)
    if activation_checkpointing:
        apply_activation_checkpointing(stage, spec, activation_checkpointing)
    if compile:
        apply_compile(stage, spec)
    apply_fsdp(stage, spec, mesh, dims)
