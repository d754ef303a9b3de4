"""Tied input and output embeddings under any layout.

A family that ties its head to its token embedding (Gemma, SmolLM3, Cohere, small Qwen3s) holds
one matrix for both in transformers. The engine holds two: the embedding on the first pipeline
stage, the head on the last, laid out alike (vocab-sharded over tp, then over the FSDP ranks).
The head starts from the embedding's value; after each backward their gradients are summed, on
one rank when it holds both (pp = 1, or a V schedule's rank 0), else exchanged between the
first and last stage's ranks of the same (dp, cp, tp) position; both then take the same update,
so they stay equal, and the gradient norm counts the pair once (the head is left out of it).
What trains is the tied model: its losses, its gradient, its weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raytrain_hybrid.distributed import pipeline
from raytrain_hybrid.models.common import init_value


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TiedEmbedding:
    def __init__(self, spec, mesh, dims, par, num_stages: int) -> None:
        self.embed_path, self.head_path = spec.first_stage[0], spec.last_stage[-1]
        self.embed_name, self.head_name = f"{self.embed_path}.weight", f"{self.head_path}.weight"
        self.pp = dims.pp
        self.peer = None  # the global rank holding the other end, when not this one
        if dims.pp > 1:
            pp_rank = mesh.pp.get_local_rank()
            owner = {
                s: r for r in range(dims.pp) for s in pipeline.stage_ids(par.schedule, r, dims.pp, par.stages_per_rank)
            }
            first, last = owner[0], owner[num_stages - 1]
            ranks = dist.get_process_group_ranks(mesh.pp.get_group())
            if first != last and pp_rank in (first, last):
                self.peer = ranks[last if pp_rank == first else first]
            self.group = mesh.pp.get_group()
        self.embed = self.head = None

    @classmethod
    def of(cls, spec, hf_config, mesh, dims, par, num_stages: int) -> TiedEmbedding | None:
        return cls(spec, mesh, dims, par, num_stages) if spec.tied(hf_config) else None

    def initial(self, full: dict, shapes: dict, seed: int, std: float) -> None:
        """The head's initial value is the embedding's (drawn under the embedding's name)."""
        if self.head_name in full:
            full[self.head_name] = init_value(self.embed_name, shapes[self.head_name], "normal", seed, std)

    def bind(self, modules, optimizer) -> None:
        for m in modules:
            for path, attr in ((self.embed_path, "embed"), (self.head_path, "head")):
                try:
                    mod = m.get_submodule(path)
                except AttributeError:
                    continue
                if mod is not None:
                    setattr(self, attr, mod.weight)
        if self.head is not None and hasattr(optimizer, "exclude_from_norm"):
            optimizer.exclude_from_norm(self.head)

    def counted(self, params: list) -> list:
        """The parameters whose gradients the norm counts: the head's is the embedding's."""
        return [p for p in params if p is not self.head]

    @torch.no_grad()
    def sum_grads(self) -> None:
        embed = self.embed if self.embed is not None and self.embed.grad is not None else None
        head = self.head if self.head is not None and self.head.grad is not None else None
        if embed is None and head is None:  # a middle stage, or a frozen (LoRA) base
            return
        if embed is not None and head is not None:
            total = _local(embed.grad) + _local(head.grad)
            _local(embed.grad).copy_(total)
            _local(head.grad).copy_(total)
            return
        if self.peer is None:
            return
        mine = _local((embed if embed is not None else head).grad)
        theirs = torch.empty_like(mine)
        ops = [
            dist.P2POp(dist.isend, mine.contiguous(), self.peer, self.group),
            dist.P2POp(dist.irecv, theirs, self.peer, self.group),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        mine.add_(theirs)
