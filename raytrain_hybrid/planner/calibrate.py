"""``raytrain-hybrid calibrate``: measure this machine as a hardware profile for the planner.

Matmul throughput of one worker (its torch threads), and gloo all-reduce bandwidth and
latency between two local processes. The profile is a JSON file that ``plan --hardware``
and ``sweep`` read.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

from raytrain_hybrid.storage import cache_dir


def default_profile() -> Path:
    """Where `calibrate` writes and `sweep` looks for this machine's profile by default."""
    return cache_dir() / "local.json"


def matmul_tflops(n: int = 1024, threads: int = 1, seconds: float = 1.0) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def _peer(rank: int, port: int, nbytes: int, hidden: int, tokens: int, reps: int, out) -> None:
    """One of two local processes: a gloo all-reduce of 4 bytes and of ``nbytes``, then a TP=2
    column-wise + row-wise pair beside its local twin. Both measurements in one pair of processes:
    each process start imports torch (seconds of CPU)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", rank=rank, world_size=2, store=store)
    times = _allreduce_times(nbytes)
    times.update(_tp_times(hidden, tokens, reps))
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def _allreduce_times(nbytes: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    small, big = torch.zeros(1), torch.zeros(nbytes // 4)
    for t in (small, big):
        dist.all_reduce(t)  # warm up the connection
    times = {}
    for name, t, reps in (("small", small, 50), ("big", big, 5)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        times[name] = (time.perf_counter() - t0) / reps
    return times


def _tp_times(hidden: int, tokens: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    x = torch.randn(tokens, hidden)

    def pair():
        return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def timed(module) -> float:
        for _ in range(2):
            module(x).sum().backward()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            module(x).sum().backward()
        return (time.perf_counter() - t0) / reps

    local = timed(pair())
    mesh = init_device_mesh("cpu", (2,))
    tp = timed(parallelize_module(pair(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}))
    return {"local": local, "tp": tp}


def measure_pair(nbytes: int = 16 * 2**20, hidden: int = 128, tokens: int = 512, reps: int = 20) -> dict:
    """Two local gloo processes' measurements: bus bandwidth (GB/s) and latency (s) of an
    all-reduce, and ``tp_pair_overhead_s``: seconds a column-wise + row-wise pair (an MLP, or
    attention's projections) costs under TP=2 beyond half its local compute, forward and
    backward (DTensor dispatch plus the all-reduces: on CPUs with gloo this, not wire time, is
    what TP costs for small models)."""
    import torch.distributed as dist

    # The pair's store, served here on a port the OS picks as it binds: a free port looked up
    # first may be taken by another process before a peer binds it (the peers then never meet).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(r, store.port, nbytes, hidden, tokens, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    times = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    del store
    latency = times["small"]
    return {
        # A 2-rank all-reduce moves 2*(n-1)/n = 1x the buffer per rank.
        "gbps": nbytes / max(times["big"] - latency, 1e-9) / 1e9,
        "latency_s": latency,
        "tp_pair_overhead_s": max(0.0, times["tp"] - times["local"] / 2),
    }


def calibrate(path: Path | None = None, threads: int = 1) -> dict:
    """Measure this machine (matmul, gloo all-reduce, TP pair overhead) into a profile file."""
    from raytrain_hybrid.planner.hardware import Hardware

    tflops = matmul_tflops(threads=threads)
    pair = measure_pair()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hw = Hardware(
        name=f"local ({os.cpu_count()} CPUs, {threads} thread(s) per worker, gloo)",
        gpus_per_node=max(os.cpu_count() or 1, 8),  # logical workers share the node
        memory_bytes=float(memory),
        peak_tflops=tflops,
        efficiency=0.5,
        intra_node_gbps=pair["gbps"],
        inter_node_gbps=pair["gbps"],
        latency_s=pair["latency_s"],
        cores=os.cpu_count() or 1,
        tp_pair_overhead_s=pair["tp_pair_overhead_s"],
    )
    profile = dataclasses.asdict(hw)
    path = path or default_profile()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return profile
