"""Hang diagnostics on gloo: a rank that does not reach a step's all-reduce while the other waits in
it is named, from the ranks' flight records, by the watch thread of every rank (no collective)."""

from __future__ import annotations

import json

from gloo_harness import launch_ranks


def _stuck(rank: int, world: int, out: str) -> list[dict] | None:
    import time

    import torch
    import torch.distributed as dist

    from raytrain_hybrid.engine.hang import HangWatch
    from raytrain_hybrid.storage import open_store

    watch = HangWatch(open_store(out).child("hang"), rank, world, timeout_s=1.0, gather_s=3.0)
    x = torch.ones(2)
    dist.all_reduce(x)  # step 4 of a run: both ranks arrive
    watch.begin(4)
    if rank == 1:
        time.sleep(6)  # stuck before step 5's all-reduce, which rank 0 waits in
    dist.all_reduce(x)
    watch.end()
    watch.close()
    return watch.report


def test_a_hung_all_reduce_names_the_rank_that_did_not_arrive(tmp_path):
    report = launch_ranks(_stuck, 2, str(tmp_path), env={"TORCH_FR_BUFFER_SIZE": "64"})
    assert len(report) == 1, report
    hung = report[0]
    assert hung["collective"] == "gloo:all_reduce" and hung["seq"] == 2, hung
    assert hung["not_arrived"] == [1] and hung["arrived"] == [0] and hung["no_record"] == [], hung
    written = json.loads((tmp_path / "hang" / "report.json").read_text())
    assert written["said"] == (
        "step 5 hangs in gloo:all_reduce #2 of default_pg: ranks [1] did not arrive (ranks [0] wait in it)"
    ), written
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == ["fr_rank0.json", "fr_rank1.json", "report.json"]


def _stuck_run(rank: int, world: int, out: str) -> dict | None:
    import time

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.trainer import Trainer
    from raytrain_hybrid.engine.worker import run_worker

    step_fn = Trainer.train_step

    def slow(self, step, batch, **kw):
        if rank == 1 and step == 1:
            time.sleep(6)  # rank 1 stuck in its second step; rank 0 waits for its gradients
        return step_fn(self, step, batch, **kw)

    Trainer.train_step = slow
    sets = ["train.steps=2", "model.num_layers=2", "train.global_batch_size=4", "model.seq_len=32"]
    layout = ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"]
    run_worker(load_config(None, [*sets, *layout, "run.hang_timeout_s=1", f"run.output_dir={out}"]), node_id="n")
    return None


def test_run_hang_timeout_s_reports_the_rank_a_step_waits_for(tmp_path):
    """Through the worker loop (run.hang_timeout_s): step 2's gradient all-reduce, rank 1 missing."""
    launch_ranks(_stuck_run, 2, str(tmp_path))
    written = json.loads((tmp_path / "hang" / "report.json").read_text())
    assert written["step"] == 2 and written["collectives"], written
    assert all(c["not_arrived"] == [1] and c["arrived"] == [0] for c in written["collectives"]), written
    assert written["said"].startswith("step 2 hangs in gloo:"), written
