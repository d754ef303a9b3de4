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
