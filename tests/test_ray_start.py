"""A private local Ray that does not come up in time (a busy machine: Ray gives its raylet 30 s)
is started once more, and a second failure is one line, not Ray's traceback."""

from __future__ import annotations

import pytest

from raytrain_hybrid.launch.runtime import session

TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


@pytest.fixture
def inits(monkeypatch):
    """ray.init's calls; each takes the next outcome of ``inits.outcomes`` (an exception or None)."""
    import ray

    class Calls(list):
        outcomes: list = []

    calls = Calls()

    def init(**kw):
        calls.append(kw)
        outcome = calls.outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    # No real start left anything: what a failed start leaves is test_what_a_failed_start_leaves_is_its_own's.
    # (Killing in this process would reach the processes the suite's background clusters start.)
    monkeypatch.setattr(session, "left_by_a_failed_start", lambda before: [])
    return calls


def test_a_start_that_timed_out_is_tried_once_more(inits):
    inits.outcomes = [Exception(TIMED_OUT), None]
    session._start_local_ray(3)
    assert [c["num_cpus"] for c in inits] == [3, 3]


def test_a_second_timeout_is_said_in_one_line_with_what_to_do(inits):
    inits.outcomes = [Exception(TIMED_OUT), Exception(TIMED_OUT)]
    with pytest.raises(session.RayStartError) as caught:
        session._start_local_ray(3)
    assert len(inits) == 2
    said = str(caught.value)
    assert said.startswith("the local Ray did not start (2 tries; Ray: The current node timed out during startup.")
    assert "\n" not in said and "--address" in said


def test_another_failure_is_not_retried(inits):
    inits.outcomes = [RuntimeError("port 6379 is taken")]
    with pytest.raises(RuntimeError, match="port 6379"):
        session._start_local_ray(3)
    assert len(inits) == 1


def test_what_a_failed_start_leaves_is_its_own():
    """A failed ray.init's leftovers are this process's Ray children born since the start began,
    with their children; not a child that was there before, nor one that is not Ray's (the CLI
    process has no other; the test process does: the background clusters' heads and drivers)."""
    import subprocess
    import sys
    import time

    import psutil

    sleeper = "import time; time.sleep(60)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(60)"
    old = subprocess.Popen([sys.executable, "-c", parent, "ray-before"])
    before = {p.pid for p in psutil.Process().children()}
    ours = subprocess.Popen([sys.executable, "-c", parent, "ray-gcs"])
    other = subprocess.Popen([sys.executable, "-c", parent, "not-it"])
    try:
        deadline = time.time() + 30
        while not psutil.Process(ours.pid).children() and time.time() < deadline:
            time.sleep(0.05)
        left = {p.pid for p in session.left_by_a_failed_start(before)}
        grandchild = psutil.Process(ours.pid).children()[0].pid
        assert {ours.pid, grandchild} <= left
        assert old.pid not in left and other.pid not in left
    finally:
        for proc in (old, ours, other):
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()


def test_prepare_data_says_a_failed_start_in_one_line(monkeypatch, tmp_path, capsys):
    from raytrain_hybrid.launch.runtime.quiet_run import prepare_command

    def join(_address):
        raise session.RayStartError("the local Ray did not start (2 tries; Ray: timed out)")

    monkeypatch.setattr(session, "join_ray", join)
    rc = prepare_command(
        str(tmp_path / "corpus.txt"), str(tmp_path / "out"), text_column="text", tokenizer="", address=""
    )
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "error: prepare-data failed: the local Ray did not start (2 tries" in err
    assert "Traceback" not in err


def test_sigterm_while_ray_starts_ends_as_the_clis_handler_ends_it():
    # ray.init's own handler exits with SystemExit(15): the CLI's handler (Terminated) is what ends the run
    import signal

    from raytrain_hybrid.launch.runtime.driver import Terminated, sigterm_ends_the_run

    with sigterm_ends_the_run(), pytest.raises(Terminated), session._sigterm_kept():
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as ray.init sets its own
        raise SystemExit(signal.SIGTERM)
