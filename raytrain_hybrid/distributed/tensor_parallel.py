"""Apply an architecture's TP plan (DTensor) to a stage: its blocks, its embedding and head.

With sequence parallelism (Korthikanti et al. 2022) the residual stream between the
TP regions is sharded along the sequence (dim 1) instead of replicated: the norms run
on 1/tp of the tokens (``SequenceParallel``), each attention/MLP input is all-gathered
(``PrepareModuleInput``), and each row-wise output is reduce-scattered back to sequence
shards instead of all-reduced. Same communication volume, activations / tp.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from raytrain_hybrid.distributed.lora import ReplicateParallel, adapter_plan
from raytrain_hybrid.models.spec import ArchSpec

SEQ = Shard(1)  # [batch, sequence, hidden]


def _style(style: str, sp: bool):
    between = SEQ if sp else Replicate()  # layout of the residual stream between TP regions
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=between)
    if style == "colwise_gather":  # transformers' colwise_gather_output: the whole output on every rank
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise_split":  # transformers' rowwise_split_input: a whole input, this rank's columns
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "embedding":
        # Vocab-parallel embedding: each rank holds vocab/tp rows; partial lookups are summed
        # (all-reduce, or reduce-scatter onto sequence shards).
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if style == "head":
        # Vocab-parallel head: each rank computes vocab/tp logits; they are gathered for the loss.
        return ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    if style == "norm":
        return SequenceParallel()
    if style == "seqnorm":  # a norm whose output meets local tensors (a post-norm's residual add)
        return SequenceParallel(use_local_output=True)
    if style == "gather_hidden":
        return GatherHidden()
    if style == "whole":  # gathered in, run whole on every rank, this rank's sequence shard out
        return GatherHidden(shard_output=True)
    if style.startswith("replicate"):  # a LoRA adapter's weight, whole on every rank
        return ReplicateParallel(between if style == "replicate:between" else Replicate())
    if style == "headnorm":
        # A norm over each attention head (Qwen3's q_norm, k_norm) on this rank's heads: its
        # input is the head-sharded projection (dim 2), its weight replicated, its gradient summed.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "moe":
        # A mixture-of-experts block whose weights are replicated over tp: it routes the whole
        # sequence (gathered) on every TP rank, and hands back this rank's sequence shard.
        return PrepareModuleInputOutput(
            input_layouts=(SEQ,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(SEQ,),
        )
    if style.startswith("gather"):
        # The module's input (positional, or the keyword after the colon) is all-gathered.
        _, _, kwarg = style.partition(":")
        if kwarg:
            return PrepareModuleInput(
                input_kwarg_layouts={kwarg: SEQ}, desired_input_kwarg_layouts={kwarg: Replicate()}
            )
        return PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),))
    raise ValueError(f"unknown TP style {style!r}")


class GatherHidden(ParallelStyle):
    """A module's hidden states all-gathered from sequence shards, as the block passes them: its
    first positional argument, or ``hidden_states`` by keyword (transformers' blocks call their
    attention one way and their MLP the other); a plain tensor out, as the TP styles inside take.
    ``shard_output``: the module's output (or its first element) is whole and the same on every rank
    (no row-wise projection reduces it): this rank keeps its sequence shard."""

    def __init__(self, shard_output: bool = False) -> None:
        super().__init__()
        self.shard_output = shard_output

    def _apply(self, module, device_mesh):
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (SEQ,), run_check=False)
            return x.redistribute(device_mesh, (Replicate(),)).to_local()

        def shard(_, args, out):
            first = out[0] if isinstance(out, tuple) else out
            first = DTensor.from_local(first, device_mesh, (Replicate(),), run_check=False)
            first = first.redistribute(device_mesh, (SEQ,)).to_local()
            return (first, *out[1:]) if isinstance(out, tuple) else first

        if self.shard_output:
            module.register_forward_hook(shard)

        def hook(_, args, kwargs):
            if args and isinstance(args[0], torch.Tensor):
                return (gather(args[0]), *args[1:]), kwargs
            if isinstance(kwargs.get("hidden_states"), torch.Tensor):
                return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            return None

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _owned(stage, path: str) -> bool:
    parent, _, name = path.rpartition(".")
    return getattr(stage.get_submodule(parent) if parent else stage, name) is not None


def apply_tp(stage, spec: ArchSpec, tp_mesh, *, sequence_parallel: bool) -> None:
    """Column-wise in, row-wise out: one all-reduce (or all-gather + reduce-scatter with
    sequence parallelism) per attention and per MLP, in forward and backward.

    Without sequence parallelism, norms (and GPT-2's position embedding) stay replicated:
    their inputs are full activations on every TP rank, so their gradients agree.
    """
    tp = tp_mesh.size()
    # A style re-registers the parameters it distributes (SequenceParallel as trainable): a
    # frozen one (a LoRA run's base) stays frozen.
    frozen = {name for name, p in stage.named_parameters() if not p.requires_grad}
    block_plan = {**spec.tp_plan, **(spec.sp_plan if sequence_parallel else {})}
    for block in stage.get_submodule(spec.layers).values():
        own = spec.sp_block(block) if sequence_parallel and spec.sp_block else {}
        plan = adapter_plan(block, {**own, **block_plan})  # LoRA: the adapted linears' base, A and B
        parallelize_module(block, tp_mesh, {name: _style(s, sequence_parallel) for name, s in plan.items()})
        if spec.tp_adjust is not None:
            spec.tp_adjust(block, tp)
    outer_plan = {**spec.tp_plan_outer, **(spec.sp_plan_outer if sequence_parallel else {})}
    outer = {path: _style(s, sequence_parallel) for path, s in outer_plan.items() if _owned(stage, path)}
    if outer:
        parallelize_module(stage, tp_mesh, outer)
    for name, p in stage.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    # Hidden states entering and leaving this stage hold 1/seq_shards of the sequence.
    stage.seq_shards = tp if sequence_parallel else 1


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
        if isinstance(param, DTensor) and param.requires_grad:  # (a frozen LoRA base has no gradient)
            param.register_post_accumulate_grad_hook(hook)
