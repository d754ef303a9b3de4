"""LoRA adapters under tensor parallelism, and their initial values on any layout.

An adapted linear computes ``base(x) + scale * B(A(x))``. Its TP plan is derived from the
base linear's, as data (``adapter_plan``):

- colwise base (q/k/v, gate/up: output features sharded): base colwise, A replicated (it reads
  the whole input, as the base does), B colwise (its output rows sharded like the base's). B's
  input is a replicated DTensor, so backward all-reduces A's output gradient ([tokens, rank]):
  A's gradient is then whole and equal on every TP rank.
- rowwise base (o, down: input features sharded): base rowwise, A rowwise (it reads the
  sharded input; its [tokens, rank] output is all-reduced, or reduce-scattered onto sequence
  shards), B replicated (applied to A's output laid out as the residual stream is).

Replicated adapters are DTensors with a Replicate placement, so the global gradient norm and
ZeRO-1 count them once (distributed.utils.shard_copies) and a partial gradient is summed by
the placement alignment (tensor_parallel.align_grad_placements, or FSDP2's reduce-scatter).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from raytrain_hybrid.models.lora import ADAPTER, adapter_init, is_adapter
from raytrain_hybrid.models.lora_dropout import LayoutDropout

# The adapter's styles under a base linear's: (A, B). "between": laid out as the residual stream.
_ADAPTER_STYLES = {"colwise": ("replicate", "colwise"), "rowwise": ("rowwise", "replicate:between")}


class ReplicateParallel(ParallelStyle):
    """A linear whose weight is whole on every TP rank (a Replicate DTensor): its input is
    taken as ``layout`` (a plain tensor annotated, a DTensor redistributed), and its output,
    laid out the same way, handed on as a plain local tensor."""

    def __init__(self, layout) -> None:
        super().__init__()
        self.layout = (layout,)

    def _partition(self, name, module, mesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            dist = nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), requires_grad=param.requires_grad)
            module.register_parameter(pname, dist)

    def _input(self, module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, self.layout, run_check=False)
        return x.redistribute(placements=self.layout) if x.placements != self.layout else x

    def _output(self, module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)


def adapter_plan(block: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A block's TP plan with every adapted linear's entry replaced by its base's and its
    adapter's (the plan unchanged where nothing is adapted)."""
    out = {}
    for path, style in plan.items():
        try:
            module = block.get_submodule(path)
        except AttributeError:  # left for parallelize_module to report
            module = None
        if style not in _ADAPTER_STYLES or not hasattr(module, "base_layer"):
            out[path] = style
            continue
        a, b = _ADAPTER_STYLES[style]
        out[f"{path}.base_layer"] = style
        out[f"{path}.lora_A.{ADAPTER}"] = a
        out[f"{path}.lora_B.{ADAPTER}"] = b
    return out


@torch.no_grad()
def init_adapters(stage: nn.Module, seed: int) -> None:
    """After materialisation: each adapter's local values from its full initial value
    (models.lora.adapter_init), whatever TP / FSDP shard this rank holds."""
    for name, p in stage.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        if not is_adapter(name):
            continue
        full = adapter_init(name, tuple(p.shape), seed)
        if isinstance(p, DTensor):
            (chunk,) = p.__create_chunk_list__()
            local, offsets = p._local_tensor, tuple(chunk.offsets)
        else:
            local, offsets = p.data, (0,) * p.dim()
        if local.numel() == 0:  # an uneven FSDP shard can be empty
            continue
        index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
        local.copy_(full[index].to(local.dtype))


def place_dropout(stage: nn.Module, seed: int, first_row: int, cp: tuple[int, int]) -> None:
    """``lora.dropout``: where this rank's activations lie in the single process's, for the
    mask (models.lora_dropout): the replica's first row in the global batch, the cp slice
    ``(rank, size)`` of every row, and each row-wise adapter's TP slice of its input features
    (read off A's layout). A no-op without dropout."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    ctx = getattr(stage, "lora_dropout_context", None)
    if ctx is None:
        return
    ctx.seed, ctx.first_row, (ctx.cp_chunk, ctx.cp_chunks) = seed, first_row, cp
    for module in stage.modules():
        drops = getattr(module, "lora_dropout", None)
        drop = drops[ADAPTER] if isinstance(drops, nn.ModuleDict) and ADAPTER in drops else None
        weight = module.lora_A[ADAPTER].weight if isinstance(drop, LayoutDropout) else None
        if isinstance(weight, DTensor):
            _, offsets = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
            drop.features = (offsets[1], weight.shape[1])


def start_dropout_step(stages, step: int) -> None:
    """Before a step's first microbatch: its number, and rows counted from the replica's first."""
    for stage in stages:
        ctx = getattr(stage, "lora_dropout_context", None)
        if ctx is not None:
            ctx.step, ctx.next_row = step, ctx.first_row
