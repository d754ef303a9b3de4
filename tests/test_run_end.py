"""However a run ends after it started (a failure, Ctrl-C, SIGTERM), `train` says one line, exits
with its code (1, 130, 143), and leaves driver.log and summary.json in the run directory, the
summary saying how it ended. The driver runs as the CLI runs it, with Ray's parts stood in for
(no cluster: the run is ended while it waits for its workers); a real SIGTERM reaches it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.launch.plan.reach import Reach
from raytrain_hybrid.launch.runtime import driver, start

SETS = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1", "data.path=memory"]


class _Queue:
    def __init__(self, **kwargs):
        pass


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises on this thread before the sleep ends
    raise AssertionError("SIGTERM did not end the run")


def _fail():
    raise RuntimeError("a worker died\nits traceback")


@pytest.mark.parametrize(
    "end, code, said, ended",
    [
        (_fail, 1, "error: training failed: a worker died", "failed: RuntimeError: a worker died"),
        (KeyboardInterrupt, 130, "interrupted (Ctrl-C): the run stopped; what it wrote is in ", "interrupted (Ctrl-C)"),
        (_sigterm, 143, "terminated (SIGTERM): the run stopped; what it wrote is in ", "terminated (SIGTERM)"),
    ],
    ids=["failure", "ctrl-c", "sigterm"],
)
def test_a_run_ended_early_leaves_its_log_and_a_summary_saying_how(
    end, code, said, ended, tmp_path, monkeypatch, capsys
):
    import ray.util.queue

    def watch(*args, **kwargs):
        print("Ray's own line, for driver.log")
        if isinstance(end, type):
            raise end()
        end()

    monkeypatch.setattr(start, "run_nodes", lambda cfg: Reach([{"CPU": 4.0}]))
    monkeypatch.setattr(start, "join_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray.util.queue, "Queue", _Queue)
    monkeypatch.setattr(driver, "sink_options", dict)
    monkeypatch.setattr(driver, "make_trainer", lambda plan, **kw: None)
    monkeypatch.setattr(driver, "watch", watch)
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    got = cli.main(["train", *(a for s in [*SETS, f"run.output_dir={out}"] for a in ("--set", s))])
    err = capsys.readouterr().err
    assert got == code, err
    assert signal.getsignal(signal.SIGTERM) is before  # the CLI's handler is gone with the run
    assert said in err and "Traceback" not in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ended"] == ended and summary["steps"] == 0, summary
    assert "Ray's own line, for driver.log" in (out / "driver.log").read_text()
    assert (out / "config.json").exists() and not (out / "run.lease.json").exists()


def test_ctrl_c_while_ray_starts_leaves_the_runs_records_too(tmp_path, monkeypatch, capsys):
    """Ray's start is the longest wait before the first step, where a Ctrl-C is likeliest: the
    run directory is made then, with driver.log and a summary saying how it ended. Before the
    start (the run's checks) nothing is written, and the line says so."""

    def starting(*args, **kwargs):
        print("Ray's own line, for driver.log")
        raise KeyboardInterrupt

    monkeypatch.setattr(start, "run_nodes", lambda cfg: Reach([{"CPU": 4.0}]))
    monkeypatch.setattr(start, "join_ray", starting)
    out = tmp_path / "run"
    argv = ["train", *(a for s in [*SETS, f"run.output_dir={out}"] for a in ("--set", s))]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err == f"interrupted (Ctrl-C): the run stopped; what it wrote is in {out}\n", err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ended"] == "interrupted (Ctrl-C)" and summary["steps"] == 0, summary
    assert "Ray's own line, for driver.log" in (out / "driver.log").read_text()
    assert (out / "config.json").exists() and not (out / "run.lease.json").exists()

    def checking(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "check_before_ray", checking)
    assert cli.main([*argv[:-1], f"run.output_dir={tmp_path / 'other'}"]) == 130
    err = capsys.readouterr().err
    assert err == "interrupted (Ctrl-C) before the run started: nothing was written\n", err
    assert not (tmp_path / "other").exists()


def test_the_done_line_of_a_run_that_trained_no_step_says_so():
    """A run that ended well with no step (e.g. data.epochs too few) has no loss to format: the
    done line said so instead of failing with a traceback after the run."""
    from raytrain_hybrid.launch.records.summary import done_line

    none = {"steps": 0, "final_loss": None, "mean_tokens_per_s": None, "checkpoints": []}
    assert done_line(none, "runs/x") == "done: 0 steps trained -> runs/x"
    two = {
        "steps": 2,
        "final_loss": 7.12345,
        "mean_tokens_per_s": 12345.6,
        "checkpoints": [{"path": "runs/x/checkpoints/step_2"}],
    }
    assert done_line(two, "runs/x") == (
        "done: 2 steps, final loss 7.1235, 12,346 tokens/s -> runs/x; newest checkpoint runs/x/checkpoints/step_2"
    )
