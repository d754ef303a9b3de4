"""Replica groups as torchrun would start them, for [fault_tolerance]'s test and benchmark.

Each group is a world of forked gloo ranks (tests/gloo_harness.py's forkserver) with a store of
its own, running ``engine.worker.run_worker``; the groups meet at a torchft Lighthouse served by
the caller. What a rank does beyond the engine is set by its ``role`` (nothing in the package
changes):

- every rank marks each step it begins (``<marker>.<name>_at_<step>``) and stamps each committed
  step's metrics with its wall-clock end (``t_end``);
- ``dies_at=<step>``: rank 0 exits in the middle of that step (after its backward, before the
  groups' gradient average);
- ``waits_at=<step>``: the group waits there (up to 120 s) until ``<marker>.rejoined`` exists, so
  that it cannot finish before a restarted group is back;
- ``rejoins``: the group writes ``<marker>.rejoined`` once its Manager is up (heartbeating).

A killed group's other ranks are killed as torchrun's agent kills them (``Group.kill``).
"""

from __future__ import annotations

import os
import time

from gloo_harness import _first_report, _rank, _run_job, rendezvous


def group_job(rank: int, world: int, job: dict, marker: str, name: str, role: dict) -> dict:
    """One rank of one replica group: the engine's worker, with the role's fault and clock."""
    from raytrain_hybrid.engine import replicas
    from raytrain_hybrid.engine.trainer import Trainer

    step_fn = Trainer.train_step

    def stamped(self, *args, **kwargs):
        metrics = step_fn(self, *args, **kwargs)
        metrics["t_end"] = time.time()
        return metrics

    Trainer.train_step = stamped
    replicas.BUCKET_BYTES = role.get("bucket_bytes", replicas.BUCKET_BYTES)
    if "dies_at" in role:
        combine = replicas.ReplicaSync.combine

        def dying(self, loss, tokens):
            if rank == 0 and self.manager.current_step() == role["dies_at"]:
                os._exit(1)
            return combine(self, loss, tokens)

        replicas.ReplicaSync.combine = dying
    if role.get("rejoins"):
        init = replicas.ReplicaSync.__init__

        def joined(self, *args, **kwargs):
            init(self, *args, **kwargs)
            open(f"{marker}.rejoined", "a").close()

        replicas.ReplicaSync.__init__ = joined
    begin = replicas.ReplicaSync.begin

    def marked(self):
        step = self.manager.current_step()
        if rank == 0:
            open(f"{marker}.{name}_at_{step}", "a").close()
        if step == role.get("waits_at"):
            deadline = time.monotonic() + 120
            while not os.path.exists(f"{marker}.rejoined") and time.monotonic() < deadline:
                time.sleep(0.1)
        return begin(self)

    replicas.ReplicaSync.begin = marked
    return _run_job(rank, world, job)


def plain_job(rank: int, world: int, job: dict, marker: str, name: str) -> dict:
    """A rank of a run without fault tolerance, with the same marks and stamps (the restart path)."""
    from raytrain_hybrid.engine.trainer import Trainer

    step_fn = Trainer.train_step

    def stamped(self, step, *args, **kwargs):
        if rank == 0:
            open(f"{marker}.{name}_at_{step}", "a").close()
        metrics = step_fn(self, step, *args, **kwargs)
        metrics["t_end"] = time.time()
        return metrics

    Trainer.train_step = stamped
    return _run_job(rank, world, job)


def reached(marker: str, name: str, step: int) -> bool:
    return os.path.exists(f"{marker}.{name}_at_{step}")


def wait_until(predicate, limit: float = 240.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


class Group:
    """A group's ranks, forked, with a store of its own (as a torchrun launch has)."""

    def __init__(self, ctx, cfg, marker: str, name: str, role: dict | None = None, resume: str | None = None) -> None:
        self.store = rendezvous()
        self.queue = ctx.Queue()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port)}
        job = {"cfg": cfg, "resume": resume}
        world = cfg.parallelism.world_size
        if cfg.fault_tolerance.enabled:  # one replica group's share of the layout's workers
            from raytrain_hybrid.config.fault_tolerance import replica_groups

            world //= replica_groups(cfg.parallelism)
            body, args = group_job, (job, marker, name, role or {})
        else:
            body, args = plain_job, (job, marker, name)
        self.procs = [
            ctx.Process(target=_rank, args=(r, world, self.store.port, body, args, env, self.queue))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def died(self) -> bool:
        return any(p.exitcode not in (None, 0) for p in self.procs)

    def kill(self) -> None:  # what torchrun's agent does to the rest of a group when one worker fails
        for p in self.procs:
            p.kill()
            p.join(30)

    def outcome(self, limit: float = 300) -> tuple[str, object]:
        """("ok", rank 0's result) or ("error", the first error), the ranks ended."""
        status, payload = _first_report(self.queue, self.procs, limit=limit)
        self.kill()
        return status, payload

    def result(self, limit: float = 300):
        status, payload = _first_report(self.queue, self.procs, limit=limit)
        if status != "ok":
            self.kill()
        assert status == "ok", payload
        for p in self.procs:
            p.join(60)
        return payload
