"""Attention over packed rows (data.packing): several examples in one row, each attending only
to itself. Model semantics, free of parallelism: a stage forward builds the mask from the
position ids it is given. Imports torch when called (the specs that use it are data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[rows, seq] position ids that restart at 0 where each example begins -> the boolean
    [rows, 1, seq, seq] mask SDPA takes: query i sees key j when j <= i in the same example.

    A dense mask: SDPA runs it forward and backward on CPUs and GPUs (its memory-efficient kernel
    on CUDA), at rows x seq^2 bytes, 1 MiB a row at seq_len 1024."""
    import torch

    example = (position_ids == 0).cumsum(-1)  # which example each token is in
    same = example.unsqueeze(-1) == example.unsqueeze(-2)
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)
