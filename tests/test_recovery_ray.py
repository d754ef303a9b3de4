"""Failure recovery on Ray: a training worker's process is killed after a checkpoint; Ray Train
restarts the worker group (run.max_failures=1), it continues from that checkpoint, and the
per-step losses equal the uninterrupted single-process run's on the same Ray Data input.

This is also the oracle case of (2,1,2), 1F1B, 4 micro-batches through the launcher on Ray Data
(4 workers started twice: (2,2,2) on Ray Data is the raw-text CLI test's)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from conftest import reference_history
from test_oracle import RTOL, SHORT, _noise_only, assert_matches, layout

from raytrain_hybrid.checkpoint.export import load_full_state_dict
from raytrain_hybrid.config import Config


def _train_worker_pids() -> list[int]:
    """The session cluster's live training workers, from its own actor table: never those of
    another Ray on this machine (the submitted jobs' `ray start` head runs beside the suite,
    tests/background.py, in this process's tree: a suite run once killed a worker of its job)."""
    import ray

    actors = ray._private.state.actors().values()
    return sorted(a["Pid"] for a in actors if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE")


@pytest.mark.slow
def test_killed_worker_recovers_from_checkpoint_with_identical_losses(ray_local, tmp_path, monkeypatch):
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch import progress
    from raytrain_hybrid.launch.driver import run

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [*SHORT, *layout(2, 1, 2, "1F1B", 4), "checkpoint.interval=2", "checkpoint.keep=1",
         "run.max_failures=1", f"run.output_dir={out}", "run.progress=false"],
    )  # fmt: skip
    killed: dict = {}
    # Saves complete in the background, a step or so after they start. The worker is killed
    # once step_2 is registered with Ray Train: rank 0 tells the driver it is complete, then
    # reports it (a barrier of all ranks), then steps on; a step heard of after that is proof.
    reported: dict = {}
    handle = progress.RunLog.handle

    def handle_and_note(run_log, kind: str, payload: dict) -> None:
        handle(run_log, kind, payload)
        if kind == "checkpoint" and payload["step"] == 2:
            reported["steps_then"] = len(run_log.history)

    monkeypatch.setattr(progress.RunLog, "handle", handle_and_note)

    def kill_after_first_checkpoint() -> None:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 600
        while time.time() < deadline:
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if "steps_then" in reported and steps > max(reported["steps_then"], 2):
                pids = _train_worker_pids()
                if len(pids) == 4:
                    killed["pid"], killed["after_steps"] = pids[2], steps
                    os.kill(pids[2], signal.SIGKILL)
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    with ThreadPoolExecutor(1) as pool:  # the reference meanwhile: the run mostly waits on its workers
        reference = pool.submit(reference_history, SHORT, "ray")
        summary = run(cfg)
    killer.join(timeout=5)
    assert "pid" in killed, "the worker was never killed"
    assert not psutil.pid_exists(killed["pid"]) or psutil.Process(killed["pid"]).status() == psutil.STATUS_ZOMBIE
    assert summary["restarts"] == 1
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_matches(history, reference.result())  # every step once, as if never interrupted
    # After the restart too, the 2 ranks of each replica trained on identical rows, and the two
    # replicas on different ones.
    digests = {r["dp"]: set() for r in summary["per_rank"]}
    for r in summary["per_rank"]:
        digests[r["dp"]].add(r["input_digest"])
    assert all(len(d) == 1 for d in digests.values()) and len(set.union(*digests.values())) == 2
    assert summary["world_size"] == 4 and summary["layout"]["pp"] == 2
    # checkpoint.keep=1: only the newest (after the last step) is left, and it is intact
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_5"]
    # After the last step every parameter, gathered from that checkpoint's shards, is the
    # reference's (relative to its norm, as the gloo oracle cases compare them).
    final = out / "checkpoints" / "step_5"
    params = load_full_state_dict(final, Config.from_dict(json.loads((final / "manifest.json").read_text())["config"]))
    want = reference.result()[-1]["params"]
    assert sorted(params) == sorted(want)
    noise = _noise_only(reference.result())
    for name, w in want.items():
        if name not in noise:
            diff = float((params[name] - w).norm() / w.norm().clamp_min(1e-12))
            assert diff <= RTOL, f"final value of {name} differs by {diff:.2e} of its norm"
