"""Failure recovery on Ray: a training worker's process is killed after a checkpoint; Ray Train
restarts the worker group (run.max_failures=1), it continues from that checkpoint, and the
per-step losses equal the uninterrupted single-process run's on the same Ray Data input.

This is also the oracle case of two replicas accumulating 4 micro-batches each through the
launcher on Ray Data, and the epoch test of the launcher's feed: over one epoch of a row-id data
set each replica trains on exactly the rows the stream assigns it, from the checkpoint's position
on, and the run stops at the epoch's end. One worker a replica: 2 workers started twice (a Ray
Train worker's start is ~9 s of the suite's CPU). A replica of two pipeline stages on Ray Data
(the leader at pp=0 hands the labels to the last stage) is the storage module's first run, and
a pipeline-parallel group restarted from a checkpoint is the topology module's node loss at
(1,2,2)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest
from conftest import reference_history
from test_data_ray import SEQ, _row_id_dataset, _stream
from test_oracle import RTOL, STEPS, _noise_only, assert_matches, layout

from raytrain_hybrid.checkpoint.export import load_full_state_dict
from raytrain_hybrid.config import Config, load_config

BATCH = 16
ROWS = STEPS * BATCH  # one epoch: the oracle's steps


def _train_worker_pids() -> list[int]:
    """The session cluster's live training workers, from its own actor table: never those of
    another Ray on this machine (the submitted jobs' `ray start` head runs beside the suite,
    tests/background.py, in this process's tree: a suite run once killed a worker of its job)."""
    import ray

    actors = ray._private.state.actors().values()
    return sorted(a["Pid"] for a in actors if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE")


@pytest.mark.slow
def test_killed_worker_recovers_from_checkpoint_with_identical_losses(ray_local, tmp_path, monkeypatch):
    from raytrain_hybrid.launch.records import progress
    from raytrain_hybrid.launch.records.events import CheckpointEvent
    from raytrain_hybrid.launch.runtime.driver import run

    data = _row_id_dataset(tmp_path / "epoch", rows=ROWS)
    # train.steps beyond the epoch: data.epochs=1 ends the run (the LR schedule stays 100 steps').
    model = ("model.num_layers=4", f"train.global_batch_size={BATCH}", f"model.seq_len={SEQ}", "train.steps=100",
             f"data.path={data}", "data.epochs=1", "data.shuffle_seed=5")  # fmt: skip
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [*model, *layout(2, 1, 1, "1F1B", 4), "checkpoint.interval=2", "checkpoint.keep=1",
         "run.max_failures=1", f"run.output_dir={out}", "run.progress=false"],
    )  # fmt: skip
    killed: dict = {}
    # Saves complete in the background, a step or so after they start. The worker is killed
    # once step_2 is registered with Ray Train: rank 0 tells the driver it is complete, then
    # reports it (a barrier of all ranks), then steps on; a step heard of after that is proof.
    reported: dict = {}
    handle = progress.RunLog.handle

    def handle_and_note(run_log, event) -> None:
        handle(run_log, event)
        if isinstance(event, CheckpointEvent) and event.step == 2:
            reported["steps_then"] = len(run_log.history)

    monkeypatch.setattr(progress.RunLog, "handle", handle_and_note)

    def kill_after_first_checkpoint() -> None:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 600
        while time.time() < deadline:
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if "steps_then" in reported and steps > max(reported["steps_then"], 2):
                pids = _train_worker_pids()
                if len(pids) == 2:
                    killed["pid"], killed["after_steps"] = pids[1], steps
                    os.kill(pids[1], signal.SIGKILL)
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    with ThreadPoolExecutor(1) as pool:  # the reference meanwhile: the run mostly waits on its workers
        reference = pool.submit(reference_history, model, "ray")
        summary = run(cfg)
    killer.join(timeout=5)
    assert "pid" in killed, "the worker was never killed"
    assert not psutil.pid_exists(killed["pid"]) or psutil.Process(killed["pid"]).status() == psutil.STATUS_ZOMBIE
    assert summary["restarts"] == 1 and len(summary["restarted_from"]) == 1, summary["restarted_from"]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = reference.result()
    assert summary["steps"] == len(history) == len(want) == STEPS  # every step once; the epoch's end stops it
    assert_matches(history, want)
    # The position each step reports is where the stream stood after that step's rows, not
    # where the leader's reader thread has read ahead to (what a checkpoint records).
    assert [(h["data_epoch"], h["data_windows_in_epoch"]) for h in history] == [
        (0, BATCH * (k + 1)) for k in range(STEPS)
    ]
    assert summary["world_size"] == 2 and summary["layout"]["pp"] == 1
    # After the restart, each replica's rank trained on exactly the rows the stream assigns
    # that replica from the checkpoint's position on; the replicas' rows are the epoch once.
    (done,) = summary["restarted_from"]  # step_<N>: N steps done, at the position asserted above
    expected, rows_seen = {}, []
    for r in range(2):
        digest, batches = hashlib.sha256(), list(_stream(cfg, 2, r))
        assert len(batches) == STEPS
        for batch in batches[done:]:
            digest.update(np.ascontiguousarray(batch[:, :-1]).astype(np.int64).tobytes())
        rows_seen += [int(w[0]) for batch in batches for w in batch]
        expected[r] = digest.hexdigest()[:16]
    assert sorted(rows_seen) == list(range(ROWS)) and expected[0] != expected[1]
    assert sorted(rank["dp"] for rank in summary["per_rank"]) == [0, 1]
    for rank in summary["per_rank"]:
        assert rank["input_digest"] == expected[rank["dp"]], (rank, done)
        assert rank["input_rows"] == (STEPS - done) * BATCH // 2
    # checkpoint.keep=1: only the newest (after the last step) is left, and it is intact
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == [f"step_{STEPS}"]
    # After the last step every parameter, gathered from that checkpoint's shards, is the
    # reference's (relative to its norm, as the gloo oracle cases compare them).
    final = out / "checkpoints" / f"step_{STEPS}"
    params = load_full_state_dict(final, Config.from_dict(json.loads((final / "manifest.json").read_text())["config"]))
    assert sorted(params) == sorted(want[-1]["params"])
    noise = _noise_only(want)
    for name, w in want[-1]["params"].items():
        if name not in noise:
            diff = float((params[name] - w).norm() / w.norm().clamp_min(1e-12))
            assert diff <= RTOL, f"final value of {name} differs by {diff:.2e} of its norm"
