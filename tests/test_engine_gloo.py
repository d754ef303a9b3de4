"""Engine layer without Ray: several gloo processes run worker.run_worker directly.

Covers the schedules and DP modes the Ray-launched oracle cases do not, against
the same single-process reference.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
from conftest import reference_history

STEPS = 3
COMMON = (f"train.steps={STEPS}", "model.num_layers=4", "train.global_batch_size=16")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, overrides: list[str], queue, nodes: int, resume) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.worker import run_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    status = ("error", f"rank {rank}: did not finish")
    try:
        # Fake node ids: with nodes > 1, ranks alternate between nodes (an order Ray never
        # hands out), so the mesh must be rearranged to keep TP groups on one node.
        result = run_worker(load_config(None, overrides), node_id=f"node{rank % nodes}", resume=resume)
        status = ("ok", result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        import traceback

        status = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
    if rank == 0 or status[0] == "error":
        queue.put(status)
    queue.close()
    queue.join_thread()
    # Skip interpreter teardown: gloo's background threads can abort the process there
    # ("terminate called without an active exception") after all work is done.
    os._exit(0 if status[0] == "ok" else 1)


_PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "transformers.models.llama.modeling_llama",
    "raytrain_hybrid.engine.worker",
]


def _context():
    """Processes forked from a server that has imported torch, transformers and the engine once:
    each gloo rank starts in a fraction of a second instead of re-importing them (spawn),
    while the test process itself stays fork-free (it may hold Ray's threads)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_gloo(overrides: list[str], nodes: int = 1, resume: str | None = None) -> dict:
    from raytrain_hybrid.config import load_config

    world = load_config(None, overrides).parallelism.world_size
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, overrides, queue, nodes, resume)) for r in range(world)]
    for p in procs:
        p.start()
    status, payload = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    assert status == "ok", payload
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return payload


CASES = {
    "interleaved1f1b-1x2x2": [
        "parallelism.dp=1",
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.schedule=Interleaved1F1B",
        "parallelism.microbatches=2",
    ],
    "zbv-zero1-2x1x2": [
        "parallelism.dp=2",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.schedule=ZBVZeroBubble",
        "parallelism.microbatches=2",
        "parallelism.zero=1",
    ],
    "loopedbfs-1x1x2": [
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.schedule=LoopedBFS",
        "parallelism.microbatches=2",
    ],
    "interleavedzb-1x1x2": [
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.schedule=InterleavedZeroBubble",
        "parallelism.microbatches=2",
    ],
    "zero2-ac-2x1x2": [
        "parallelism.dp=2",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.zero=2",
        "parallelism.activation_checkpointing=true",
        "parallelism.microbatches=2",
    ],
    "zero3-tp-2x2x1": [
        "parallelism.dp=2",
        "parallelism.tp=2",
        "parallelism.pp=1",
        "parallelism.zero=3",
        "parallelism.microbatches=2",
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_single_process(name):
    history = run_gloo([*COMMON, *CASES[name]])["history"]
    reference = reference_history(COMMON)
    for got, want in zip(history, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_bfloat16_autocast_tracks_float32():
    """bf16 cannot meet the fp32 tolerance; it must still train the same model closely."""
    layout = ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1"]
    history = run_gloo([*COMMON, *layout, "train.dtype=bfloat16"])["history"]
    reference = reference_history(COMMON)
    for got, want in zip(history, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
    assert history[-1]["loss"] < history[0]["loss"]


def test_interleaved_node_order_keeps_tp_on_a_node_and_matches():
    """Ranks alternate between two nodes; TP groups must still sit on one node each."""
    layout = ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=2"]
    result = run_gloo([*COMMON, *layout], nodes=2)
    ranks = result["memory"]
    tp_groups: dict[tuple, set] = {}
    pp_groups: dict[tuple, set] = {}
    for r in ranks:
        tp_groups.setdefault((r["pp"], r["dp"]), set()).add(r["node"])
        pp_groups.setdefault((r["dp"], r["tp"]), set()).add(r["node"])
    assert all(len(nodes) == 1 for nodes in tp_groups.values()), ranks
    assert all(len(nodes) == 2 for nodes in pp_groups.values()), ranks
    # the arrangement is not the identity: rank 1 is not rank 0's TP partner
    by_rank = {r["rank"]: r for r in ranks}
    assert (by_rank[0]["pp"], by_rank[0]["dp"]) != (by_rank[1]["pp"], by_rank[1]["dp"])
    for got, want in zip(result["history"], reference_history(COMMON), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
