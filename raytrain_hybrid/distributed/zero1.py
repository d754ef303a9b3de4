"""ZeRO-1, the sharded "distributed optimizer" of Megatron-LM, on any (dp, tp, pp).

Parameters and gradients stay whole on every data-parallel rank (whole = this rank's
TP shard of its pipeline stages). At the step, the gradients of all local shards are
laid end to end in one flat buffer and reduce-scattered over the DP group: each DP
rank receives the averaged gradient of one contiguous 1/dp slice, keeps the AdamW
moments of that slice only, updates it, and the updated slices are all-gathered back
into the parameters. Optimizer memory per rank is full / (tp * pp * dp).

Hybrid sharding (parallelism.replicate > 1): the slices are cut over a shard group of
dp/replicate ranks only, and each reduce-scattered slice is then all-reduced over the
``replicate`` ranks holding the same slice in the other shard groups (one all-reduce of a
shard's size a step, across nodes); every copy updates its slice alike. Optimizer memory per
rank is then full / (tp * pp * dp/replicate).

Works on DTensor parameters through their local shards, so it composes with TP and
with any pipeline schedule (no DDP reducer: gradients accumulate locally over the
micro-batches and are reduced once per step). torch's ZeroRedundancyOptimizer
partitions whole parameters and needs DDP, which holds no DTensor; hence this class.
The update itself is torch.optim.AdamW on the flat slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raytrain_hybrid.distributed.utils import shard_copies


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class ZeroOneOptimizer(torch.optim.Optimizer):
    def __init__(
        self, params, *, dp_group, tp: int, divide: int = 0, copies: int = 0, replica_group=None, **adamw
    ) -> None:
        """``divide``: what the summed gradients are divided by (default: the group's size);
        ``copies``: the ranks of a replica's stage holding each element (default: from its placements);
        ``replica_group``: under hybrid sharding, the ranks holding the same slice in other shard groups."""
        self.model_params = list(params)
        self.group = dp_group
        self.replica_group = replica_group
        self.replicas = dist.get_world_size(replica_group) if replica_group is not None else 1
        self.dp = dist.get_world_size(dp_group)
        self.divide = divide or self.dp
        self.dp_rank = dist.get_rank(dp_group)
        sizes = [_local(p).numel() for p in self.model_params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes
        total = sum(sizes)
        self.slice_len = -(-total // self.dp)  # padded so that dp slices tile the buffer
        self.padded = self.slice_len * self.dp
        self.start = self.dp_rank * self.slice_len
        # How many ranks of one DP replica's stage hold each element: TP-replicated
        # parameters (norms, row-parallel biases) count once in the gradient norm.
        self.copies = [copies or shard_copies(p, tp) for p in self.model_params]
        device = _local(self.model_params[0]).device
        self.shard = torch.nn.Parameter(torch.zeros(self.slice_len, device=device))
        self.optim = torch.optim.AdamW([self.shard], **adamw)
        self._pull_params()
        # The Optimizer base holds param_groups/state for the LR scheduler and state dicts:
        # they are the inner AdamW's, so a scheduler's LR changes reach the update.
        self.defaults = self.optim.defaults
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._grad_ready = False

    # ------------------------------------------------------------ slices of the flat buffer

    def _segments(self):
        """(parameter index, start in the parameter, start in the slice, length) of the
        parameters that overlap this rank's slice."""
        lo, hi = self.start, self.start + self.slice_len
        for i, (off, n) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                yield i, a - off, a - lo, b - a

    @torch.no_grad()
    def _pull_params(self) -> None:
        """Copy the current parameter values of this slice into the update buffer (the
        parameters may have been set from outside, e.g. by a checkpoint load)."""
        for i, p_at, s_at, n in self._segments():
            self.shard[s_at : s_at + n] = _local(self.model_params[i]).reshape(-1)[p_at : p_at + n]

    # ------------------------------------------------------------ the step, in three parts

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the accumulated gradients: this rank gets the DP mean of its slice."""
        flat = torch.zeros(self.padded, device=self.shard.device)
        for p, off, n in zip(self.model_params, self.offsets, self.sizes, strict=True):
            if p.grad is not None:
                flat[off : off + n] = _local(p.grad).reshape(-1)
        out = torch.empty(self.slice_len, device=flat.device)
        dist.reduce_scatter_single(out, flat, group=self.group)
        if self.replicas > 1:  # hybrid sharding: the other shard groups' sums of the same slice
            dist.all_reduce(out, group=self.replica_group)
        self.shard.grad = out.div_(self.divide)
        self._grad_ready = True

    @torch.no_grad()
    def exclude_from_norm(self, param: torch.Tensor) -> None:
        """Leave ``param`` out of the gradient norm (a tied head: its gradient is the embedding's)."""
        for i, p in enumerate(self.model_params):
            if p is param:
                self.copies[i] = float("inf")

    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's part of the squared global gradient norm (sum it over the world; each slice
        is held by ``replicas`` ranks under hybrid sharding)."""
        total = torch.zeros((), dtype=torch.float64, device=self.shard.device)
        for i, _, s_at, n in self._segments():
            part = torch.linalg.vector_norm(self.shard.grad[s_at : s_at + n], dtype=torch.float64).square()
            total += part / (self.copies[i] * self.replicas)
        return total

    @torch.no_grad()
    def clip_(self, coef: float | torch.Tensor) -> None:
        self.shard.grad.mul_(coef)

    @torch.no_grad()
    def step(self, closure=None):
        if not self._grad_ready:
            self.reduce_gradients()
        self._pull_params()
        self.optim.step()
        flat = torch.empty(self.padded, device=self.shard.device)
        dist.all_gather_single(flat, self.shard.detach(), group=self.group)
        for p, off, n in zip(self.model_params, self.offsets, self.sizes, strict=True):
            local = _local(p)
            local.copy_(flat[off : off + n].view_as(local))
        self._grad_ready = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.shard.grad = None

    # ------------------------------------------------------------ checkpoints: per-parameter state

    @torch.no_grad()
    def gathered_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """AdamW's state per parameter (id -> step, exp_avg, exp_avg_sq), shaped like the
        parameter (a DTensor where it is one), as a plain AdamW would hold it: checkpoints
        stay layout-independent. The moments are all-gathered over DP for this."""
        inner = self.optim.state[self.shard]
        step = inner["step"].clone().cpu() if inner else torch.tensor(0.0)
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            mine = inner[key] if inner else torch.zeros(self.slice_len, device=self.shard.device)
            flat = torch.empty(self.padded, device=mine.device)
            dist.all_gather_single(flat, mine, group=self.group)
            moments[key] = flat
        out = {}
        for p, off, n in zip(self.model_params, self.offsets, self.sizes, strict=True):
            state = {"step": step.clone()}
            for key, flat in moments.items():
                local = flat[off : off + n].view_as(_local(p))
                if isinstance(p, DTensor):
                    local = DTensor.from_local(
                        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                state[key] = local
            out[id(p)] = state
        return out

    @torch.no_grad()
    def scatter_state(self, per_param: dict[int, dict[str, torch.Tensor]]) -> None:
        """The inverse of gathered_state (after a checkpoint was loaded into its tensors)."""
        inner = self.optim.state[self.shard]
        for key in ("exp_avg", "exp_avg_sq"):
            buf = torch.zeros(self.slice_len, device=self.shard.device)
            for i, p_at, s_at, n in self._segments():
                value = _local(per_param[id(self.model_params[i])][key]).reshape(-1)
                buf[s_at : s_at + n] = value[p_at : p_at + n]
            inner[key] = buf
        step = per_param[id(self.model_params[0])]["step"].clone().float()
        # The fused kernel (CUDA) reads its step counter on the device, the for-loop on the host.
        inner["step"] = step.to(self.shard.device if self.optim.defaults.get("fused") else "cpu")
        self._pull_params()


class SplitZeroOne(ZeroOneOptimizer):
    """ZeRO-1 in parts, each sharded over its own group (under expert parallelism: the dense weights
    over dp, the experts over the dp/ep ranks holding the same experts), stepped, clipped and
    checkpointed as one optimizer. The parts hold all state, hence no ZeroOneOptimizer.__init__."""

    def __init__(self, *parts: ZeroOneOptimizer) -> None:
        self.parts = parts
        self.model_params = [p for part in parts for p in part.model_params]
        self.defaults = parts[0].defaults
        self.param_groups = [g for part in parts for g in part.param_groups]  # the scheduler sets each LR
        self._grad_ready = False

    @property
    def state(self) -> dict:
        """The parts' AdamW state (a ChainMap would fill the first part's defaultdict on lookups)."""
        return {k: v for part in self.parts for k, v in part.state.items()}

    def reduce_gradients(self) -> None:
        for part in self.parts:
            part.reduce_gradients()
        self._grad_ready = True

    def exclude_from_norm(self, param: torch.Tensor) -> None:
        for part in self.parts:
            part.exclude_from_norm(param)

    def grad_norm_sq(self) -> torch.Tensor:
        return sum(part.grad_norm_sq() for part in self.parts)

    def clip_(self, coef: float | torch.Tensor) -> None:
        for part in self.parts:
            part.clip_(coef)

    def step(self, closure=None):
        if not self._grad_ready:
            self.reduce_gradients()
        for part in self.parts:
            part.step()
        self._grad_ready = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def gathered_state(self) -> dict[int, dict[str, torch.Tensor]]:
        return {k: v for part in self.parts for k, v in part.gathered_state().items()}

    def scatter_state(self, per_param: dict[int, dict[str, torch.Tensor]]) -> None:
        for part in self.parts:
            part.scatter_state(per_param)
