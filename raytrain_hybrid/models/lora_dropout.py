"""LoRA dropout (``lora.dropout``) whose mask is a function of where each element is.

peft drops the adapter's input with ``nn.Dropout``, which draws from the process's random
stream: two ranks that hold the same activation (TP ranks of a replicated input) agree only if
their streams do, ranks that hold parts of one (TP feature shards, cp sequence slices, dp rows,
pipeline stages) draw a mask no single process would, and a recomputed block (activation
checkpointing) draws a new one. Here each element is kept or dropped by a hash of

    (train.seed, the adapted linear's name, the step, the row in the global batch,
     the token's position in the row, the input feature)

so every layout drops exactly the elements a single process drops, a recomputation drops them
again, and the rule can be written down (tests/reference_lora.py applies it to peft's model):

    key     = crc32(f"{seed}:{name}:{step}")               name: e.g. model.layers.0.self_attn.q_proj
    index   = (row * seq_len + position) * in_features + feature
    h       = mix(lo32(index) ^ mix(hi32(index) ^ key))    mix: the 32-bit lowbias hash below
    kept    = h >= floor(p * 2**32), scaled by 1 / (1 - p)

The step and the microbatch's first row reach the dropout through the stage's forward (a
pre-hook counts the rows its microbatches carry, from this replica's first row in the global
batch); a block's input tensor remembers them for its recomputation in backward.
"""

from __future__ import annotations

import sys
import zlib

import torch
from torch import nn

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B


def mix(x):
    """A 32-bit integer hash (an int, or an int64 tensor of values below 2**32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def step_key(seed: int, name: str, step: int) -> int:
    return zlib.crc32(f"{seed}:{name}:{step}".encode())


def keep_mask(key: int, rows, positions, features, seq_len: int, width: int, p: float) -> torch.Tensor:
    """[rows, positions, features] booleans: which elements dropout keeps (global coordinates;
    ``seq_len`` and ``width`` are the whole row's)."""
    index = (rows[:, None, None] * seq_len + positions[None, :, None]) * width + features[None, None, :]
    return mix((index & _M32) ^ mix((index >> 32) ^ key)) >= int(p * 2**32)


class DropoutContext:
    """A stage's shared state for its dropouts: what the trainer sets (seed, step, the replica's
    first row, the cp slice) and the microbatch in flight."""

    def __init__(self) -> None:
        self.seed, self.step, self.first_row = 0, 0, 0
        self.next_row = 0
        self.cp_chunk, self.cp_chunks = 0, 1
        self.current: tuple[int, int] | None = None  # (step, first row) of the microbatch entering the stage
        self.active: tuple[int, int] | None = None  # ... of the block running now (forward or recomputation)


class LayoutDropout(nn.Module):
    """peft's ``lora_dropout`` replaced: the same dropout, its mask by position (module doc)."""

    def __init__(self, p: float, name: str, context: DropoutContext) -> None:
        super().__init__()
        self.p, self.name, self.context = p, name, context
        self.features: tuple[int, int] | None = None  # (offset, whole width) of a TP-sharded input

    @torch._dynamo.disable  # Python state (step, rows): kept out of a compiled block's graph
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        ctx = self.context
        assert ctx.active is not None, "a training forward outside a stage's forward"
        step, row0 = ctx.active
        local = x.to_local() if isinstance(x, DTensor) else x
        rows, seq, width = local.shape
        seq_off, feat_off, seq_len, full_width = 0, 0, seq, width
        if isinstance(x, DTensor):  # a laid-out input: its offsets in the logical tensor
            _, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
            seq_off, feat_off, seq_len, full_width = offsets[1], offsets[2], x.shape[1], x.shape[2]
        elif self.features is not None:
            feat_off, full_width = self.features
        # Context parallelism: this rank's contiguous slice of every row.
        seq_off, seq_len = ctx.cp_chunk * seq_len + seq_off, seq_len * ctx.cp_chunks
        dev = local.device

        def span(start: int, n: int) -> torch.Tensor:
            return torch.arange(start, start + n, device=dev, dtype=torch.int64)

        key = step_key(ctx.seed, self.name, step)
        keep = keep_mask(key, span(row0, rows), span(seq_off, seq), span(feat_off, width), seq_len, full_width, self.p)
        out = local * (keep.to(local.dtype) * (1.0 / (1.0 - self.p)))
        if isinstance(x, DTensor):
            return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        return out


def install(stage, layers: str, p: float, adapter: str) -> None:
    """Replace the dropout of every adapted linear of ``stage`` (peft's, after injection) and
    hook the stage and its blocks (``layers``: their ModuleDict) to hand each its microbatch."""
    ctx = DropoutContext()
    stage.lora_dropout_context = ctx
    for name, module in stage.named_modules():
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict) and adapter in drops:
            drops[adapter] = LayoutDropout(p, name, ctx)
    stage.register_forward_pre_hook(lambda m, args: _stage_entry(ctx, m, args))
    for block in stage.get_submodule(layers).values():
        block.register_forward_pre_hook(lambda m, a, kw: _block_entry(ctx, m, a, kw), with_kwargs=True)


def _stage_entry(ctx: DropoutContext, stage, args) -> None:
    """A microbatch enters the stage: its rows follow the step's previous microbatch's."""
    x = args[0] if args else None
    if not stage.training or x is None or x.device.type == "meta":  # eval; a shape probe on meta tensors
        return
    ctx.current = (ctx.step, ctx.next_row)
    if not _metadata_probe():  # (a probe's outputs are dropped: its rows are the next microbatch's too)
        ctx.next_row += x.shape[0]


def _metadata_probe() -> bool:
    """Whether torch.distributed.pipelining calls the stage to infer its outputs' metadata (on
    the first step, before the microbatches: that forward carries no rows of the batch)."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "_compute_outputs" and "pipelining" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@torch._dynamo.disable  # (under recomputation the block's call is inside a compiled wrapper)
def _block_entry(ctx: DropoutContext, block, args, kwargs) -> None:
    """A block runs: in forward, on the microbatch entering the stage (its input remembers which);
    recomputed in backward (activation checkpointing), on the one its input remembers."""
    x = args[0] if args else kwargs.get("hidden_states")
    if not block.training or x is None:
        return
    if torch._C._current_graph_task_id() != -1:  # inside backward: a recomputation
        ctx.active = getattr(x, "_lora_dropout_microbatch", ctx.current)
    else:
        ctx.active = ctx.current
        x._lora_dropout_microbatch = ctx.current
