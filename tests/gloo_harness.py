"""The engine as plain gloo processes (no Ray), and what the oracle reads off such a run.

Each rank runs ``engine.worker.run_worker``, the function Ray Train calls. A probe, installed
in each process on the Trainer class (no hook in the package), gathers what the oracle
compares with tests/reference.py:

- the initial state: every parameter before the first optimizer step, gathered to a full
  tensor under its global name (what the reference starts from);
- per step, every parameter's gradient norm as the optimizer receives it (after clipping,
  the point at which the reference takes its own), gathered across TP, PP, FSDP and ZeRO-1
  shards by summing local squares over the world, each divided by the number of ranks that
  hold the same shard: one all-reduce of one vector per step;
- the final state, gathered like the initial one, once.

Test-only options: ``scale`` multiplies one parameter's gradient before the optimizer step
(the oracle must notice), ``watch_dtypes`` records the dtypes of the Linear layers' outputs
(bf16 runs must show autocast ran), ``fail_save=(step, rank)`` makes that rank's save of
checkpoint step_<step> fail half-way (after DCP's write, while it hashes its files).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import numpy as np

_PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "transformers.models.llama.modeling_llama",
    "raytrain_hybrid.engine.worker",
    "sklearn.metrics",  # classifiers' validation metrics (0.8 s a process to import)
]
# Activation checkpointing wraps each block; the global name is the unwrapped one.
_WRAPPED = "_checkpoint_wrapped_module."


def rendezvous():
    """The store a launch's gloo ranks meet at, served by the test process on a port the OS
    picks as it binds (ranks connect to ``store.port``; keep the object alive until they are
    done). A port picked first and bound again later by rank 0 can be taken in between by
    any of the suite's other processes (Ray's bind many): rank 0 then fails, and the other
    ranks wait for it."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_group(rank: int, world: int, port: int) -> None:
    """In a forked rank: the default gloo group, through the launch's store (rendezvous)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)


def context():
    """Processes forked from a server that has imported torch, transformers and the engine once:
    each gloo rank starts in a fraction of a second instead of re-importing them (spawn),
    while the test process itself stays fork-free (it may hold Ray's threads)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _holders(t, ranks: int) -> int:
    """How many of ``ranks`` ranks (those over which a stage's tensor is laid out) hold the
    same local shard of ``t``: a plain tensor is whole on each; a DTensor is replicated along
    its Replicate mesh dimensions (any other placement shards it) and on the ranks outside its mesh."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return ranks
    assert not any(p.is_partial() for p in t.placements), t.placements  # no pending sums
    mesh = t.device_mesh
    replicated = math.prod(mesh.size(d) for d, p in enumerate(t.placements) if p.is_replicate())
    return ranks // mesh.size() * replicated


class Probe:
    def __init__(self, scale: tuple[str, float] | None = None, watch_dtypes: bool = False) -> None:
        self.scale, self.watch_dtypes = scale, watch_dtypes
        self.trainer = None
        self.grad_norms: list[dict[str, float]] = []
        self.dtypes: set[str] = set()

    def install(self) -> None:
        from raytrain_hybrid.engine.trainer import Trainer

        init = Trainer.__init__
        probe = self

        def probed_init(trainer, *args, **kwargs):
            init(trainer, *args, **kwargs)
            probe.attach(trainer)

        Trainer.__init__ = probed_init  # this process only (a forked gloo rank)

    def attach(self, trainer) -> None:
        import torch
        import torch.distributed as dist

        self.trainer = trainer
        self.local = [(n.replace(_WRAPPED, ""), p) for m in trainer.modules for n, p in m.named_parameters()]
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, [n for n, _ in self.local])
        self.names = sorted({n for part in parts for n in part})
        self.index = {n: i for i, n in enumerate(self.names)}
        self.initial = self.gather_full()
        opt = trainer.optimizer
        step = opt.step  # (LambdaLR's counting wrapper around it)

        def probed_step(*args, **kwargs):
            self._before_step()
            return step(*args, **kwargs)

        opt.step = probed_step
        if self.watch_dtypes:
            for m in trainer.modules:
                for mod in m.modules():
                    if isinstance(mod, torch.nn.Linear):
                        mod.register_forward_hook(lambda _m, _i, out: self.dtypes.add(str(out.dtype)))

    def _before_step(self) -> None:
        import torch
        import torch.distributed as dist

        from raytrain_hybrid.distributed.zero1 import ZeroOneOptimizer

        opt, dims = self.trainer.optimizer, self.trainer.dims
        sq = torch.zeros(len(self.names), dtype=torch.float64)
        with torch.no_grad():
            if isinstance(opt, ZeroOneOptimizer):
                # The reduced, clipped gradients are the flat slice this rank updates.
                # Under ep, in parts: each sliced over its own group (the experts over the dp/ep ranks
                # holding the same experts), so the stage's other ranks lay out dp*tp / group size copies.
                name_of = {id(p): n for n, p in self.local}
                for z in getattr(opt, "parts", [opt]):
                    ranks = dims.dp * dims.cp * dims.tp // dist.get_world_size(z.group)
                    lo, hi = z.start, z.start + z.slice_len
                    for p, off, size in zip(z.model_params, z.offsets, z.sizes, strict=True):
                        a, b = max(lo, off), min(hi, off + size)
                        if a >= b:
                            continue
                        part = z.shard.grad[a - lo : b - lo]
                        if self.scale and name_of[id(p)] == self.scale[0]:
                            part.mul_(self.scale[1])
                        sq[self.index[name_of[id(p)]]] += part.double().pow(2).sum().item() / _holders(p, ranks)
            else:
                for n, p in self.local:
                    if p.grad is None:
                        continue
                    if self.scale and n == self.scale[0]:
                        p.grad.mul_(self.scale[1])
                    g = p.grad
                    local = g.to_local() if hasattr(g, "to_local") else g
                    sq[self.index[n]] += local.double().pow(2).sum().item() / _holders(g, dims.dp * dims.cp * dims.tp)
        dist.all_reduce(sq)
        self.grad_norms.append(dict(zip(self.names, sq.sqrt().tolist(), strict=True)))

    def gather_full(self) -> dict[str, np.ndarray] | None:
        """Every parameter as a full tensor, on rank 0 (None elsewhere)."""
        import torch
        import torch.distributed as dist

        t = self.trainer
        lead = t.dp_rank == 0 and t.mesh.tp.get_local_rank() == 0  # one writer per stage
        mine = {}
        with torch.no_grad():
            for n, p in self.local:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p  # collective on p's mesh
                if lead:
                    mine[n] = full.detach().float().cpu().numpy().copy()
        rank = dist.get_rank()
        parts = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if rank == 0 else None

    def report(self, final: bool = True) -> dict:
        return {
            "initial": self.initial,
            "grad_norms": self.grad_norms,
            "final": self.gather_full() if final else None,
            "dtypes": sorted(self.dtypes),
        }


_REPORTS = None  # in a forked rank: the queue to the test (for _progress)


def _progress(rank: int, what: str) -> None:
    """Rank 0 tells the test that a part of a long launch finished: the test's limit is on a
    launch that stops moving, not on how many jobs it holds (CI's machines are slower than ours)."""
    if rank == 0 and _REPORTS is not None:
        _REPORTS.put(("progress", what))


def _rank(rank: int, world: int, port: int, body, args: tuple, env: dict, queue) -> None:
    """A forked gloo rank: join the group, run ``body(rank, world, *args)``, and hand rank 0's
    result (or this rank's error) to the test."""
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank that dies of a signal (a native crash: seen twice in CI as a peer's "connection
    # closed" in a pipeline send, its exit code -11) prints where each thread was to its stderr,
    # which pytest shows with the failure.
    faulthandler.enable(all_threads=True)
    os.environ.update(env)
    torch.set_num_threads(1)
    global _REPORTS
    _REPORTS = queue
    join_group(rank, world, port)
    try:
        status = ("ok", body(rank, world, *args))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        status = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
    if rank == 0 or status[0] == "error":
        queue.put(status)
    queue.close()
    queue.join_thread()
    # Skip interpreter teardown: gloo's background threads can abort the process there
    # ("terminate called without an active exception") after all work is done.
    os._exit(0 if status[0] == "ok" else 1)


def _run_job(rank: int, world: int, job: dict) -> dict:
    from raytrain_hybrid.config import load_config

    cfg = job["cfg"] if "cfg" in job else load_config(None, job["overrides"])
    probe = Probe(job.get("scale"), job.get("watch_dtypes", False))
    probe.install()
    if job.get("fail_save"):
        _fail_save(*job["fail_save"])
    if job.get("init_only"):
        _build_only(cfg)
        result = {}
    else:
        from raytrain_hybrid.engine.plan import WorkerPlan
        from raytrain_hybrid.engine.worker import run_worker

        # Fake node ids: with nodes > 1, ranks alternate between nodes (an order Ray never
        # hands out), so the mesh must be rearranged to keep TP groups on one node.
        nodes = job.get("nodes", 1)
        result = run_worker(WorkerPlan(cfg, resume=job.get("resume")), f"node{rank % nodes}")
    result["probe"] = probe.report(final=not job.get("init_only"))
    return result


def _fail_save(step: int, rank: int) -> None:
    """In this process only: the save of step_<step> fails on ``rank`` (a disk error half-way)."""
    import re

    import torch.distributed as dist

    from raytrain_hybrid.checkpoint import save

    digest = save.file_digest

    def failing(path):
        if re.search(rf"step_{step}[./]", str(path)) and dist.get_rank() == rank:
            raise OSError(f"injected failure reading back {path}")
        return digest(path)

    save.file_digest = failing


def _build_only(cfg) -> None:
    import torch

    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
    from raytrain_hybrid.engine.trainer import Trainer

    dims = ParallelDims.from_config(cfg.parallelism)
    Trainer(cfg, dims, dims.build_mesh("cpu", arrange_ranks(dims, ["n"] * dims.world_size)), torch.device("cpu"))


def _first_report(queue, procs, limit: float = 600.0):
    """Rank 0's result or the first error; a rank that died without a word fails at once, and
    ``limit`` s without a word (a result, an error or rank 0's progress) fails too."""
    import queue as queues
    import time

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            status, payload = queue.get(timeout=2)
            if status != "progress":
                return status, payload
            deadline = time.monotonic() + limit
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                return "error", f"a rank exited with {dead[0]} before reporting"
    return "error", f"no report within {limit:.0f} s of the last"


def _the_other_ranks(queue, procs, grace: float = 3.0) -> str:
    """After the first error, what the other ranks said or how they ended within ``grace`` s: a
    rank that reports a peer's reset is often not the one that failed (one killed by a signal,
    for instance, says nothing itself)."""
    import queue as queues
    import time

    said = []
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            status, text = queue.get(timeout=0.2)
        except queues.Empty:
            continue
        if status == "error":
            said.append(text.splitlines()[0])
    ends = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}
    return f"\nthen: {said or 'no other rank reported'}; exit codes by rank (negative: a signal): {ends}"


def launch_ranks(body, world: int, *args, env: dict | None = None):
    """``body(rank, world, *args)`` in ``world`` forked gloo ranks (``env`` added to each one's
    environment); returns rank 0's result, or fails the test with the first error."""
    ctx = context()
    queue = ctx.Queue()
    store = rendezvous()
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, body, args, env or {}, queue)) for r in range(world)]
    for p in procs:
        p.start()
    status, payload = _first_report(queue, procs)
    if status != "ok":
        payload += _the_other_ranks(queue, procs)
    for p in procs:
        if status != "ok":  # the others may wait on the failed rank in a collective: not for minutes
            p.kill()
        p.join(timeout=120)
    del store
    assert status == "ok", payload
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return payload


def _launch(job: dict, env: dict | None = None) -> dict:
    from raytrain_hybrid.config import load_config

    world = (job["cfg"] if "cfg" in job else load_config(None, job["overrides"])).parallelism.world_size
    return launch_ranks(_run_job, world, job, env=env)


def run_gloo(overrides: list[str], nodes: int = 1, resume: str | None = None, env: dict | None = None, **probe) -> dict:
    """run_worker's result on rank 0 (history, per-rank memory, ...) plus ``"probe"``; ``env`` is
    added to each rank's environment."""
    return _launch({"overrides": list(overrides), "nodes": nodes, "resume": resume, **probe}, env)


def initial_state(cfg) -> dict[str, np.ndarray]:
    """The engine's parameters for ``cfg`` before any step, gathered to full tensors (built at
    (1,1,1) in one process; every layout's own initial state must equal it)."""
    import dataclasses

    single = dataclasses.replace(cfg.parallelism, dp=1, tp=1, pp=1, microbatches=1, zero=0)
    job = {"cfg": dataclasses.replace(cfg, parallelism=single), "init_only": True}
    return _launch(job)["probe"]["initial"]


def _run_jobs(rank: int, world: int, jobs: dict) -> dict:
    """One gloo rank running several jobs in turn (run_worker each, with its own Probe):
    one launch of ``world`` processes instead of one per job (their start-up, the group's, and
    the first import of the data path's modules are most of a small run's time)."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
    from raytrain_hybrid.engine.trainer import Trainer
    from raytrain_hybrid.engine.worker import run_worker

    out: dict = {}
    init = Trainer.__init__
    _one_mesh_per_layout()
    for name, job in jobs.items():
        # A list of overrides, or {"overrides": [...], "resume": checkpoint} (a resumed run),
        # with "notice": (rank, step) a preemption notice that rank alone hears before that step,
        # "nodes": N fake nodes the ranks alternate between, "auto_hardware": a profile (a dict)
        # for an elastic layout=auto start, which picks its layout as a Ray worker group does.
        job = job if isinstance(job, dict) else {"overrides": job}
        probe = Probe()
        if job.get("probe", True):  # (False: a benchmark's run, timed without the probe's gathers and norms)
            probe.install()
        notice = _notice(rank, *job["notice"]) if "notice" in job else None
        node_id, said = f"node{rank % job.get('nodes', 1)}", []
        try:
            if job.get("register"):  # models registered from Python, as launch.runtime.entry registers them again
                from raytrain_hybrid.models.custom import restore

                restore(job["register"])
            cfg = load_config(None, job["overrides"])
            if "auto_hardware" in job:
                from raytrain_hybrid.launch.plan.autolayout import group_layout
                from raytrain_hybrid.planner.hardware import Hardware

                cfg, said = group_layout(cfg, node_id, Hardware(**job["auto_hardware"]))
            result = run_worker(WorkerPlan(cfg, resume=job.get("resume")), node_id, WorkerIO(notice=notice))
        finally:
            Trainer.__init__ = init  # the next job's probe, not this one's too
        out[name] = {**result, "probe": probe.report() if probe.trainer else None, "said": said}
        _progress(rank, name)
    return out


def _one_mesh_per_layout() -> None:
    """In this rank: jobs of one layout share one DeviceMesh (and its process groups). A mesh's
    groups live as long as the process (DTensor's caches keep the mesh, and meshes of one layout
    compare equal, so a later job's ops already run on an earlier job's groups): a new set per
    job left each of 30 jobs three gloo threads per group more, and every job slower than the
    one before (3.4 s to 7.6 s over ten 8-rank jobs)."""
    import dataclasses

    from raytrain_hybrid.distributed.parallel_dims import ParallelDims

    build, meshes = ParallelDims.build_mesh, {}

    def build_once(self, device_type: str, arrangement: list[int]):
        # Every degree in the key, not only the mesh's shape: the engine keeps what it derives
        # from the dims on the mesh (expert parallelism's mesh, by ep and the ZeRO stage).
        key = (device_type, tuple(arrangement), dataclasses.astuple(self))
        if key not in meshes:
            meshes[key] = build(self, device_type, arrangement)
        return meshes[key]

    ParallelDims.build_mesh = build_once


def _notice(rank: int, heard_by: int, step: int):
    """run_worker's ``notice``: true on rank ``heard_by`` from its look before ``step`` on."""
    looks = iter(range(10**9))
    return lambda: rank == heard_by and next(looks) >= step


def run_gloo_jobs(world: int, jobs: dict[str, list[str] | dict], env: dict | None = None) -> dict[str, dict]:
    """{job: what run_gloo returns for its overrides}, all jobs in one launch of ``world`` ranks,
    in order (a job {"overrides": [...], "resume": path} resumes from a checkpoint; ``world`` may
    differ from the layout's own for an elastic run, parallelism.min_dp); ``env`` is added to
    each rank's environment."""
    return launch_ranks(_run_jobs, world, jobs, env=env)
