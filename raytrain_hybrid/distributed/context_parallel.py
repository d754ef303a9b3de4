"""Context parallelism: each rank of a cp group holds a contiguous 1/cp slice of every sequence.

Everything in a transformer block but attention works token by token, so a rank runs the whole
model on its slice (inputs, labels, RoPE positions of the slice). Attention needs every key: an
all-to-all (DeepSpeed-Ulysses) turns q/k/v from sequence-sharded, all heads, into head-sharded,
whole sequence; SDPA runs causal over the whole sequence for cp's share of the heads; a second
all-to-all turns the output back: four all-to-alls a layer forward (q, k, v in, the output back)
and four in backward, each moving (cp-1)/cp of one tensor of the rank's; no ring. all_to_all runs
on gloo (CPU) and NCCL.

The attention is a transformers attention function (``ALL_ATTENTION_FUNCTIONS``) selected by the
hf config's attention implementation; its cp group is an attribute of each attention module set
here: the model code stays free of parallelism. Heads after TP must divide by cp; key/value heads
that do not are repeated (by the least factor that makes them divide, which always divides the
query heads per key head when the query heads divide) before the exchange.

torch's ``context_parallel`` (ring attention, load-balanced) dispatches only the CUDA SDPA kernels
in torch 2.13, so it cannot run or be tested on CPU: this path is the one that runs everywhere.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain_hybrid.models.packed import document_mask

ATTENTION = "raytrain_cp"  # the name registered with transformers' AttentionInterface


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (cp equal chunks); its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, heads, s/cp, d] (this rank's slice) -> [b, heads/cp, s, d] (its heads, every slice)."""
    b, h, s, d = x.shape
    chunks = x.permute(1, 0, 2, 3).reshape(cp, h // cp, b, s, d)  # chunk j: the heads rank j gets
    got = _AllToAll.apply(chunks, group)  # got[j]: rank j's slice of this rank's heads
    return got.permute(2, 1, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, heads/cp, s, d] -> [b, s/cp, heads, d] (this rank's slice, every head: transformers'
    attention output layout)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, cp, s // cp, d).permute(2, 1, 0, 3, 4)  # chunk j: slice j, for rank j
    got = _AllToAll.apply(chunks, group)  # got[j]: this slice of rank j's heads
    return got.reshape(cp * h, b, s // cp, d).permute(1, 2, 0, 3)


def kv_repeats(kv_heads: int, cp: int) -> int:
    """The least r such that kv_heads * r divides by cp (repeat each key/value head r times)."""
    return cp // math.gcd(kv_heads, cp)


def cp_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """A transformers attention function: q [b, h, s/cp, d], k/v [b, kv, s/cp, d] of this rank's
    slice -> ([b, s/cp, h, d], None). ``attention_mask``: None (causal) or packed documents' mask,
    rebuilt for the whole sequence from the ``position_ids`` transformers passes on."""
    group, cp = module.cp_group, module.cp_size
    r = kv_repeats(key.shape[1], cp)
    if r > 1:
        key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
    q, k, v = (seq_to_heads(t, group, cp) for t in (query, key, value))
    # What SDPA does not do: a family that adds it is refused before workers start (models.generic_cp).
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise RuntimeError(f"{type(module).__name__} soft-caps or adds sinks, which context parallelism does not")
    mask = attention_mask
    if mask is not None and mask.shape[-1] != q.shape[-2]:  # built from this rank's slice only
        mask = whole_sequence_mask(kwargs["position_ids"], group, cp)
    # Grouped-query attention: each key head serves a group of query heads (not repeated in memory).
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa
    )
    return heads_to_seq(out, group, cp), None


def whole_sequence_mask(position_ids: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Packed rows (data.packing): the stage built its document mask from its own slice's
    position ids; attention over the whole sequence needs the whole rows' ([rows, 1, s, s]),
    made the same way from every cp rank's position ids."""
    return document_mask(gather_positions(position_ids, group, cp))


def gather_positions(position_ids: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The whole rows' position ids ([rows, s]) from every cp rank's slice ([rows, s/cp]), in order."""
    parts = [torch.empty_like(position_ids) for _ in range(cp)]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def use_cp_attention(hf_config) -> None:
    """Register the cp attention with transformers and select it on ``hf_config`` (before the
    model is built: its attention modules read the config's implementation)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, cp_attention)
    hf_config._attn_implementation = ATTENTION


def apply_cp(stage, spec, cp_mesh) -> None:
    """Give each block's attention module (``spec.attention``: its path in a block) the cp group,
    and the stage the index of this rank's sequence slice (the positions RoPE gives it)."""
    group, cp = cp_mesh.get_group(), cp_mesh.size()
    for block in stage.get_submodule(spec.layers).values():
        attn = block.get_submodule(spec.attention)
        attn.cp_group, attn.cp_size = group, cp
    stage.seq_chunk = cp_mesh.get_local_rank()
    # For a stage that builds its masks per layer type (models.generic_forward): the whole rows' positions.
    stage.whole_positions = functools.partial(gather_positions, group=group, cp=cp)


def local_slice(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous 1/cp of ``x`` along ``dim`` (the sequence)."""
    return x.chunk(cp, dim=dim)[rank].contiguous()
