"""Hang diagnostics on gloo: a rank that does not reach a step's all-reduce while the other waits in
it is named, from the ranks' flight records, by the watch thread of every rank (no collective)."""

from __future__ import annotations

import json
import os

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
    from raytrain_hybrid.engine.plan import WorkerPlan
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
    run_worker(WorkerPlan(load_config(None, [*sets, *layout, "run.hang_timeout_s=1", f"run.output_dir={out}"])), "n")
    return None


def test_run_hang_timeout_s_reports_the_rank_a_step_waits_for(tmp_path):
    """Through the worker loop (run.hang_timeout_s): step 2's gradient all-reduce, rank 1 missing."""
    launch_ranks(_stuck_run, 2, str(tmp_path))
    written = json.loads((tmp_path / "hang" / "report.json").read_text())
    assert written["step"] == 2 and written["collectives"], written
    assert all(c["not_arrived"] == [1] and c["arrived"] == [0] for c in written["collectives"]), written
    assert written["said"].startswith("step 2 hangs in gloo:"), written


def test_nccl_runs_get_the_flight_recorder_and_ray_trains_hang_detector(tmp_path, monkeypatch):
    """On NCCL, run.hang_timeout_s sets torch's flight-recorder variables on every worker before the
    process group is made (by the backend Ray Train calls) and Ray Train's NCCL hang detector on the
    driver, at the names this Ray reads; gloo runs and runs without the key are left as they were."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend
    from ray.train.v2._internal import constants as ray_train
    from ray.train.v2._internal.callbacks.nccl_ras import NCCLRASCallback

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine import hang
    from raytrain_hybrid.launch.runtime.backend import RunTorchConfig, torch_config

    detector_keys = (ray_train.ENABLE_NCCL_HANG_DETECTOR_ENV_VAR, ray_train.NCCL_RAS_CONFIRM_DURATION_S_ENV_VAR)
    # The driver's environment, as a copy this test may change
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in detector_keys})
    off = load_config(None, [f"run.output_dir={tmp_path}"])
    on = load_config(None, ["run.hang_timeout_s=300", f"run.output_dir={tmp_path}"])
    assert type(torch_config(off, "nccl")) is TorchConfig and type(torch_config(on, "gloo")) is TorchConfig
    assert not set(detector_keys) & set(os.environ)

    made = torch_config(on, "cpu:gloo,cuda:nccl")
    assert isinstance(made, RunTorchConfig) and made.backend == "cpu:gloo,cuda:nccl"
    prefix = hang.nccl_dump_prefix(str(tmp_path))
    assert made.worker_env == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    detector = NCCLRASCallback()  # as the trainer makes it from the driver's environment
    assert detector._confirm_duration_s == 300.0 and detector._action == ray_train.NCCL_RAS_ACTION_OBSERVE

    calls = []

    class Workers:  # Ray Train's worker group, as the backend sees it
        def execute(self, fn, *args):
            calls.append(("execute", fn, args))

    monkeypatch.setattr(_TorchBackend, "on_start", lambda self, wg, bc: calls.append(("process group", bc.backend)))
    made.backend_cls().on_start(Workers(), made)
    assert [c[0] for c in calls] == ["execute", "process group"], calls
    assert calls[0][1] is hang.set_env and calls[0][2] == (made.worker_env,)


def test_nccl_dumps_on_a_node_are_gathered_into_the_run_directory(tmp_path, monkeypatch):
    """torch's NCCL dump of a timed-out rank (a file at the prefix the variables name) is copied to
    hang/nccl/ in the run directory and removed from the node; a variable the user set is kept."""
    from raytrain_hybrid.engine import hang
    from raytrain_hybrid.storage import open_store

    local = tmp_path / "node" / "trace_"
    environ = {k: v for k, v in os.environ.items() if k not in hang.DUMP_PREFIX_VARS}
    monkeypatch.setattr(os, "environ", {**environ, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(local)})
    hang.set_env({k: str(tmp_path / "ours" / "x_") for k in hang.DUMP_PREFIX_VARS})
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(local) and local.parent.is_dir()
    del os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    for rank in (0, 3, 5):
        (local.parent / f"trace_{rank}").write_bytes(b"pickled record %d" % rank)
        if rank != 5:  # rank 5's dump is still being written: left for the next look
            os.utime(local.parent / f"trace_{rank}", (0, 0))
    store = open_store(str(tmp_path / "run")).child("hang")
    assert hang.gather_nccl_dumps(store) == ["trace_0", "trace_3"]
    os.utime(local.parent / "trace_5", (0, 0))
    assert hang.gather_nccl_dumps(store) == ["trace_5"]
    assert (tmp_path / "run" / "hang" / "nccl" / "trace_3").read_bytes() == b"pickled record 3"
    assert list(local.parent.iterdir()) == [] and hang.gather_nccl_dumps(store) == []
