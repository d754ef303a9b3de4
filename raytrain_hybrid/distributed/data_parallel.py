"""Data parallelism on the ``dp`` axis with PyTorch's own modules.

zero=0: FSDP2 on a (dp_replicate=dp, dp_shard=1) HSDP mesh, i.e. plain replication
        with gradient all-reduce. torch DDP cannot hold DTensor (TP) parameters, FSDP2
        composes with TP, so replication goes through FSDP2 at every tp.
zero=1: no wrapper; ZeroOneOptimizer reduce-scatters gradients and shards AdamW state and
        the update over dp (distributed/zero1.py), at every tp and pp; under ep the experts in
        their own ZeRO-1 over the dp/ep ranks holding the same experts.
replicate > 1 (hybrid sharding, dp = replicate x shard): FSDP2 (zero=2/3) on the (dp_replicate,
        dp_shard) HSDP mesh, ZeRO-1 sliced over the shard group and all-reduced over the replicas.
zero=2: FSDP2 sharding, parameters kept gathered between forward and backward.
zero=3: FSDP2 full sharding, parameters re-gathered for backward.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from raytrain_hybrid.distributed.expert_parallel import ep_mesh, is_expert, shard_experts
from raytrain_hybrid.distributed.parallel_dims import ParallelDims
from raytrain_hybrid.distributed.zero1 import SplitZeroOne, ZeroOneOptimizer
from raytrain_hybrid.models.spec import ArchSpec


def apply_fsdp(stage, spec: ArchSpec, mesh, dims: ParallelDims) -> None:
    """Before materialisation (meta device): wrap each block, then the stage root."""
    if dims.dp * dims.cp == 1 or dims.zero == 1:  # the cp ranks of a replica average gradients too
        return
    fsdp_mesh = mesh.fsdp
    reshard = dims.zero == 3
    # float32 reduction keeps the replicas' averaged gradients equal to one process's.
    mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    if dims.ep > 1:  # the experts first, on the mesh of the ranks holding the same experts
        shard_experts(stage, spec, mesh, dims, reshard_after_forward=reshard, mp_policy=mp)
    for block in stage.get_submodule(spec.layers).values():
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(stage, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def adamw_kernel(device: torch.device) -> dict:
    """AdamW's implementation: on CUDA the fused kernel (one launch per step for all parameters;
    torch 2.13 runs it on plain tensors and on DTensor shards alike, _ops/_pointwise_ops.py);
    elsewhere torch's default (the for-loop on CPU, as the single-process oracle runs it)."""
    return {"fused": True} if device.type == "cuda" else {}


def build_optimizer(params, mesh, dims: ParallelDims, *, device: torch.device, **adamw):
    adamw = {**adamw, **adamw_kernel(device)}
    if dims.zero == 1 and dims.dp * dims.cp > 1:
        if dims.replicate > 1:  # hybrid sharding: sliced over dp/replicate x cp, the slices all-reduced
            shard, copies = mesh.shard.get_group(), mesh.replicate.get_group()
            return ZeroOneOptimizer(
                params, dp_group=shard, tp=dims.tp, divide=dims.dp * dims.cp, replica_group=copies, **adamw
            )
        group = (mesh.grads if dims.cp > 1 else mesh.dp).get_group()  # sharded over dp x cp
        if dims.ep > 1:
            return _zero1_with_experts(list(params), mesh, dims, group, adamw)
        return ZeroOneOptimizer(params, dp_group=group, tp=dims.tp, **adamw)
    return torch.optim.AdamW(params, **adamw)


def _zero1_with_experts(params, mesh, dims: ParallelDims, dp_group, adamw: dict) -> ZeroOneOptimizer:
    """ZeRO-1 under ep: the dense weights sliced over dp as without experts; the experts' local
    shards sliced over the dp/ep x cp ranks holding the same experts, their gradients summed there and
    divided by dp x cp (as the experts' FSDP unit does at ZeRO-0, expert_parallel.py). An expert element
    is whole on each tp rank, on one rank of the ep group: tp copies in the gradient norm."""
    experts = [p for p in params if is_expert(p)]
    parts = [ZeroOneOptimizer([p for p in params if not is_expert(p)], dp_group=dp_group, tp=dims.tp, **adamw)]
    if experts:  # a pipeline stage without MoE layers has none (nor do the other ranks of its group)
        same = ep_mesh(mesh.world, dims)["erep"].get_group()
        divide = dims.dp * dims.cp  # the loss's average over dp x cp
        parts.append(ZeroOneOptimizer(experts, dp_group=same, tp=dims.tp, divide=divide, copies=dims.tp, **adamw))
    return SplitZeroOne(*parts)
