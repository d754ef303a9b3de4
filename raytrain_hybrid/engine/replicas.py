"""Per-step fault tolerance over the replica groups ([fault_tolerance], torchft).

Each replica group is a process group of its own (shard x cp x tp x pp workers) that trains the
layout's model on its part of every global batch; the groups meet at every step in a quorum
(torchft's ``Manager``, one per worker, the Lighthouse deciding who is in). In a step:

1. ``begin``: the quorum. A group that is behind (restarted after a failure) receives the weights,
   optimizer state and step from a live group first (torchft's transport over the process group,
   rank r of one group to rank r of the other: the layouts are the same, so are the local shards).
2. ``combine`` (after the backward, inside the group the gradients are already reduced): the
   groups in the quorum add up their token counts, and their gradients weighted by their tokens,
   so the step's gradient is the mean over the tokens that were present (a missing group's rows
   are not in the step) and the loss is that mean's loss. The groups in the step are recorded.
3. ``should_commit``: every group agrees that the step is whole; only then the optimizer steps.
   A step given up (a group failed during it) is retried at the next quorum with the same rows.

The step a group trains comes from the quorum, so its data are a function of the step
(:class:`StepBatches`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.fault_tolerance import replica_groups


def group_config(cfg: Config) -> Config:
    """The config one replica group trains as its own process group: its share of the global
    batch, dp the shard ranks of one group (replicate 1), the same model, seed and schedule."""
    par, groups = cfg.parallelism, replica_groups(cfg.parallelism)
    shard = par.dp // groups
    gb = cfg.train.global_batch_size
    if gb % groups:
        raise ValueError(f"train.global_batch_size={gb} must divide over {groups} replica groups")
    return dataclasses.replace(
        cfg,
        parallelism=dataclasses.replace(par, dp=shard, replicate=1),
        train=dataclasses.replace(cfg.train, global_batch_size=gb // groups),
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def named_lighthouse(cfg: Config) -> str:
    """The Lighthouse the config or TORCHFT_LIGHTHOUSE names ("" for none)."""
    return cfg.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def lighthouse_address(cfg: Config) -> str:
    addr = named_lighthouse(cfg)
    if not addr:
        from raytrain_hybrid.errors import ConfigError

        raise ConfigError(
            "fault_tolerance.lighthouse",
            "",
            "names no Lighthouse and TORCHFT_LIGHTHOUSE is not set; start one (raytrain-hybrid lighthouse) and "
            "give its address",
        )
    return addr if "://" in addr else f"http://{addr}"


# The gradients' all-reduce across groups goes in flat fp32 buckets of this size (DDP's default).
BUCKET_BYTES = 25 * 2**20


def _buckets(grads: list[torch.Tensor]):
    """Consecutive runs of ``grads`` of at most BUCKET_BYTES in fp32 (a larger tensor alone)."""
    bucket, size = [], 0
    for g in grads:
        if bucket and size + 4 * g.numel() > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += 4 * g.numel()
    if bucket:
        yield bucket


def _unpack(bucket: list[torch.Tensor], flat: torch.Tensor, work) -> None:
    """A bucket's all-reduce waited for, its sums copied back into the gradients."""
    work.wait()
    with torch.no_grad():
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(part.view_as(g))


# How long one quorum request waits before it is asked again (ReplicaSync._quorum).
QUORUM_ASK_S = 15.0


class ReplicaSync:
    """This worker's side of the replica groups' quorum (one torchft Manager a worker)."""

    def __init__(self, cfg: Config, trainer, group: int, device: torch.device, start: int = 0) -> None:
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        ft = cfg.fault_tolerance
        self.trainer, self.group, self.groups = trainer, group, replica_groups(cfg.parallelism)
        timeout = timedelta(seconds=ft.step_timeout_s)
        self.lighthouse = lighthouse_address(cfg)
        if device.type == "cuda":
            from torchft import ProcessGroupNCCL

            pg = ProcessGroupNCCL(timeout=timeout)
        else:
            pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ft.min_replicas,
            # The quorum is waited for before the forward: a group that was behind has the live
            # groups' state before it computes, and takes part in the same step.
            use_async_quorum=False,
            # Every group builds the same initial weights from train.seed: nothing to send at step 0.
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=ft.quorum_timeout_s),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            replica_id=f"replica_group_{group}",
            lighthouse_addr=self.lighthouse,
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
        )
        if start:  # resumed from a checkpoint of that step: the quorum starts there (a group behind heals)
            self.manager.load_state_dict({"step": start, "batches_committed": 0})
        self.healed_at: int | None = None  # the step this group was given by a live one, if it was
        self.started, self.quorum_timeout_s, self.min_replicas = False, ft.quorum_timeout_s, ft.min_replicas

    # -- the state a live group sends to one that rejoins: this rank's local shards --------------

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor of this rank's training state, in an order the same on every group."""
        out = []
        for module in self.trainer.modules:
            out += [_local(t) for t in module.state_dict().values() if torch.is_tensor(t)]
        opt = getattr(self.trainer.optimizer, "optim", self.trainer.optimizer)
        for p in self.trainer.params:
            state = opt.state.get(p, {})
            out += [_local(state[k]) for k in sorted(state) if torch.is_tensor(state[k])]
        return out

    def _state(self) -> dict:
        return {"tensors": [t.detach() for t in self._tensors()]}

    def _load(self, state: dict) -> None:
        opt = getattr(self.trainer.optimizer, "optim", self.trainer.optimizer)
        if not opt.state:  # a group that never stepped: its optimizer state made as the live group's
            self._zero_step()
        mine = self._tensors()
        theirs = state["tensors"]
        if len(mine) != len(theirs):
            raise RuntimeError(f"a live replica group sent {len(theirs)} state tensors for this rank's {len(mine)}")
        with torch.no_grad():
            for dst, src in zip(mine, theirs, strict=True):
                dst.copy_(src)

    def _zero_step(self) -> None:
        """Creates the optimizer's state (AdamW's moments and step) without changing a weight."""
        opt = getattr(self.trainer.optimizer, "optim", self.trainer.optimizer)
        saved = [(g, g["lr"], g.get("weight_decay", 0.0)) for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        for p in self.trainer.params:
            p.grad = torch.zeros_like(p)
        type(opt).step(opt)  # the class's step: not a wrapper that counts optimizer steps
        opt.zero_grad(set_to_none=True)
        for g, lr, wd in saved:
            g["lr"], g["weight_decay"] = lr, wd

    # -- the step -------------------------------------------------------------------------------

    def begin(self) -> int:
        """The step's quorum; returns the step this group trains now (a rejoining group's jumps
        to the live groups' step, its state received)."""
        before = self.manager.current_step()
        self._quorum()
        if not self.started:  # a run's first step waits for every group (up to the quorum timeout)
            self._await_all(before)
        self._await_enough()
        step = self.manager.current_step()
        if step != before:
            self.healed_at = step
            self.trainer.restore_schedule(step)
        return step

    def _await_all(self, before: int) -> None:
        """At the run's start, quorums again until every group is in one: the first group up would
        otherwise train alone until the others join (each then receiving its state). A group that
        starts into a run already going (a restart) is given the live groups' step instead."""
        self.started = True
        deadline = time.monotonic() + self.quorum_timeout_s
        while (
            before == 0
            and self.manager.current_step() == 0
            and self.manager.num_participants() < self.groups
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
            self._quorum()

    def _await_enough(self) -> None:
        """Fewer groups than fault_tolerance.min_replicas: quorums again until enough are back, for
        at most fault_tolerance.quorum_timeout_s, then the run stops saying so."""
        deadline = time.monotonic() + self.quorum_timeout_s
        while (n := self.manager.num_participants()) < self.min_replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {n} replica group(s) in the quorum for {self.quorum_timeout_s:.0f} s "
                    f"(fault_tolerance.quorum_timeout_s), fewer than fault_tolerance.min_replicas="
                    f"{self.min_replicas}: the run stops; restart the lost groups, or lower min_replicas"
                )
            time.sleep(0.5)
            self._quorum()

    def _quorum(self) -> None:
        """One quorum, asked again every QUORUM_ASK_S until fault_tolerance.quorum_timeout_s: a
        Lighthouse whose process died takes the request it held with it and never answers it;
        started again at the same address (Ray restarts the Lighthouse actor a launch of every
        group starts), it answers the request asked again."""
        deadline = time.monotonic() + self.quorum_timeout_s
        while True:
            ask = max(1.0, min(QUORUM_ASK_S, deadline - time.monotonic()))
            try:
                self.manager.start_quorum(timeout=timedelta(seconds=ask))
                return
            except Exception as exc:
                if time.monotonic() + 1.0 >= deadline:  # the Lighthouse gone, or unreachable
                    raise RuntimeError(
                        f"no quorum from the Lighthouse at {self.lighthouse} within {self.quorum_timeout_s:.0f} s "
                        f"(fault_tolerance.quorum_timeout_s): {exc}. If the Lighthouse is gone, start it again and "
                        "--resume each replica group from its newest checkpoint"
                    ) from exc
                # torchft's next start_quorum would raise this failed request's error again first.
                self.manager._quorum_future = None
                time.sleep(1.0)

    def combine(
        self, loss: torch.Tensor, tokens: int, aux: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """The groups' gradients weighted by their tokens, in place; returns the step's loss over
        the tokens present, the groups that contributed, and ``aux`` (a mixture of experts' router
        loss, part of ``loss``) weighted as the loss is."""
        from torch.distributed import ReduceOp

        stats = torch.zeros(3 + self.groups, dtype=torch.float64, device=loss.device)
        stats[0], stats[1], stats[3 + self.group] = loss.double() * tokens, float(tokens), 1.0
        stats[2] = 0.0 if aux is None else aux.double() * tokens
        self.manager.allreduce(stats, reduce_op=ReduceOp.SUM).wait()
        present = stats[1].clamp(min=1.0)
        params = self.trainer.params
        for p in params:
            if p.grad is None:  # a parameter this group's rows did not reach: zero, as the others see it
                p.grad = torch.zeros_like(p)
        scale = (tokens / present).float()
        # In buckets of BUCKET_BYTES, two in flight: one flat copy of every gradient would double
        # the gradients' memory for the length of the all-reduce.
        pending: list[tuple[list[torch.Tensor], torch.Tensor, object]] = []
        for bucket in _buckets([_local(p.grad) for p in params]):
            flat = torch.cat([g.reshape(-1).float() for g in bucket]) * scale
            pending.append((bucket, flat, self.manager.allreduce(flat, reduce_op=ReduceOp.SUM)))
            if len(pending) > 1:
                _unpack(*pending.pop(0))
        for done in pending:
            _unpack(*done)
        groups = [i for i in range(self.groups) if stats[3 + i] > 0.5]
        return (stats[0] / present).float(), groups, (stats[2] / present).float()

    def should_commit(self) -> bool:
        return bool(self.manager.should_commit())

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class StepBatches:
    """A replica group's batch for the step the quorum gives: the same rows again when a step
    is retried, and the input started anew at the step a rejoining group jumps to."""

    def __init__(self, open_at: Callable[[int], Callable[[int], object]], start: int) -> None:
        self.open_at = open_at  # step -> a next_batch function that starts there
        self.next_step, self.read = start, open_at(start)
        self.last: tuple[int, object] | None = None

    def __call__(self, step: int):
        if self.last is not None and self.last[0] == step:
            return self.last[1]
        if step != self.next_step:
            self.read = self.open_at(step)
        batch = self.read(step)
        self.next_step, self.last = step + 1, (step, batch)
        return batch
