"""One run per output directory: the lease a run takes, on a local disk and on the S3 server.

A second run on the same run.output_dir is refused, naming the holder; a holder that died
leaves a lease that expires (at once when its process is gone on this host), so a resume of a
crashed run needs no manual step; of many drivers starting at once on one directory, one wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from s3_server import s3_server

from raytrain_hybrid.cli import main as cli
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.records.lease import LEASE, acquire
from raytrain_hybrid.storage import open_store


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        yield env


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    request.getfixturevalue("s3")
    return f"s3://bucket/{tmp_path.name}/run"


def test_a_second_run_is_refused_naming_the_holder_until_the_first_ends(out, monkeypatch):
    monkeypatch.setenv("RAY_JOB_SUBMISSION_ID", "raysubmit_first")
    first = acquire(out)
    with pytest.raises(ConfigError, match="is in use by another run") as refused:
        acquire(out)
    message = str(refused.value)
    assert f"host {socket.gethostname()}, process {os.getpid()}" in message and "job raysubmit_first" in message
    assert (
        first.renew()
        and json.loads(open_store(out).child(LEASE).read_text())["renewed_at"] >= first.body["renewed_at"] - 1e-6
    )
    first.release()
    assert not open_store(out).child(LEASE).exists()
    acquire(out).release()


def test_a_dead_holders_lease_is_taken_over(out):
    """A lease whose process is gone (this host), or not renewed within its ttl (any host)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lease = open_store(out).child(LEASE)
    holder = {"host": socket.gethostname(), "pid": int(dead.stdout), "started_at": "x", "job": "", "token": "t1"}
    lease.write_text(json.dumps({"holder": holder, "renewed_at": time.time(), "ttl_s": 120}))
    taken = acquire(out)
    assert json.loads(lease.read_text())["holder"]["token"] == taken.token
    taken.release()
    elsewhere = {**holder, "host": "another-node", "pid": 1, "token": "t2"}
    lease.write_text(json.dumps({"holder": elsewhere, "renewed_at": time.time() - 121, "ttl_s": 120}))
    acquire(out).release()
    lease.write_text(json.dumps({"holder": elsewhere, "renewed_at": time.time(), "ttl_s": 120}))  # alive elsewhere
    with pytest.raises(ConfigError, match="host another-node, process 1"):
        acquire(out)


def test_of_drivers_starting_at_once_one_holds_the_directory(out):
    won, refused = [], []

    def start() -> None:
        try:
            won.append(acquire(out))
        except ConfigError:
            refused.append(1)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 5
    won[0].release()


def test_the_cli_refuses_a_run_on_a_directory_in_use(tmp_path, capsys):
    """As a user meets it: `train` on a directory another driver holds exits 2 before Ray starts
    and leaves the other run's lease as it was."""
    out = tmp_path / "run"
    holder = acquire(str(out))
    before = (out / LEASE).read_bytes()
    code = cli(["train", "--set", f"run.output_dir={out}", "--set", "train.steps=2"])
    assert code == 2
    assert f"run.output_dir='{out}': is in use by another run (host {socket.gethostname()}" in capsys.readouterr().err
    assert (out / LEASE).read_bytes() == before and sorted(p.name for p in out.iterdir()) == [LEASE]
    holder.release()


def test_a_save_completes_only_under_the_lease_its_run_started_under(out):
    """A driver killed (or cut off) while its workers save: once another run has taken the lease
    over, the workers' save does not complete (the other run may have chosen its checkpoint);
    under the run's own lease, or with no lease at all (no driver), it completes."""
    from raytrain_hybrid.checkpoint.save import LEASE_FILE, CheckpointSaveError, _Finish, lease_epoch
    from raytrain_hybrid.storage import private_dir

    assert LEASE_FILE == LEASE
    root = open_store(out).child("checkpoints")

    def finish(step: int, epoch) -> _Finish:
        staging = private_dir("test-lease") / f"{os.getpid()}-{step}"
        staging.mkdir(parents=True, exist_ok=True)
        if root.local:  # (on a disk the staging directory is renamed into place)
            staging = Path(root.path) / f"step_{step}.partial"
            staging.mkdir(parents=True)
        return _Finish(root, root.child(f"step_{step}"), staging, 0, 1, None, {"step": step}, 0.0, epoch)

    first = acquire(out)
    epoch = lease_epoch(root)
    assert epoch == first.token
    finish(2, epoch)._complete({})
    assert root.child("step_2", "manifest.json").exists()
    first.release()  # its driver gone; the next run takes the directory
    second = acquire(out)
    with pytest.raises(CheckpointSaveError, match="another run took over the lease on .* not completed"):
        finish(4, epoch)._complete({})
    assert not root.child("step_4").exists() or not root.child("step_4", "manifest.json").exists()
    second.release()
    finish(6, lease_epoch(root))._complete({})  # no lease: a run without a driver saves as before
    assert root.child("step_6", "manifest.json").exists()


def test_a_run_sees_that_its_lease_was_taken_over(out):
    """What the driver asks before it prunes or writes summary.json: after another run took the
    directory over, the lease is no longer held, and ``lost`` names the run that has it."""
    first = acquire(out)
    assert first.held() and not first.lost
    first.backend.delete(first._ours()[2])  # as if it had expired and been taken over
    second = acquire(out)
    assert not first.held() and f"process {os.getpid()}" in first.lost
    second.release()


def test_a_driver_whose_lease_is_taken_over_stops_at_once(tmp_path, monkeypatch, capsys):
    """The driver looks at its lease while the run goes on: once another run has taken it over, it
    stops the run there and then (the workers' saves are refused from the takeover on), and the
    CLI ends with an error naming the run that has the directory now, leaving its files alone."""
    from types import SimpleNamespace

    from ray.util.queue import Empty

    from raytrain_hybrid.launch.records import lease as lease_module
    from raytrain_hybrid.launch.records.lease import LeaseLost
    from raytrain_hybrid.launch.runtime import driver

    monkeypatch.setattr(driver, "LEASE_LOOK_S", 0.05)
    out = tmp_path / "run"
    first = acquire(str(out))
    cfg = SimpleNamespace(run=SimpleNamespace(output_dir=str(out)))

    class Trainer:  # a run that would go on for a minute
        def fit(self):
            time.sleep(60)

    class Sink:
        def empty(self):
            return True

        def get(self, timeout):
            time.sleep(0.02)
            raise Empty

    watchdog = SimpleNamespace(start=lambda t: None, news=[])
    run_log = SimpleNamespace(live_steps=1)
    taken: dict = {}

    def take_over() -> None:
        time.sleep(0.3)
        monkeypatch.setattr(lease_module, "expired", lambda lease: True)  # as if not renewed in time
        # Noted before the takeover: the driver may see it and stop before acquire() returns here.
        taken["at"] = time.time()
        taken["second"] = acquire(str(out))  # replaces it in one step

    taker = threading.Thread(target=take_over)
    taker.start()
    lost = lambda: None if first.held() else driver.lease_lost(cfg, first.held)  # noqa: E731 - as the driver's
    with pytest.raises(LeaseLost, match=rf"taken over by another run \(host .*, process {os.getpid()}.*stopped"):
        driver.watch(Trainer(), Sink(), run_log, watchdog, {"launched": time.time()}, lost=lost)
    assert time.time() - taken["at"] < 1.0  # not at the run's end: within a look or two
    taker.join()
    second_lease = (out / LEASE).read_bytes()

    # The CLI: exit 1 with the error said, and neither summary.json nor driver.log written into the
    # directory that is the other run's now.
    def lost_run(*args, **kwargs):
        print("what Ray said")
        raise driver.lease_lost(cfg, first.held)

    monkeypatch.setattr(driver, "run", lost_run)
    assert cli(["train", "--set", f"run.output_dir={out}", "--set", "train.steps=2"]) == 1
    err = capsys.readouterr().err
    assert f"error: run.output_dir={out} was taken over by another run (host " in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == [LEASE] and (out / LEASE).read_bytes() == second_lease
    taken["second"].release()


def test_a_killed_drivers_processes_end_with_it(tmp_path):
    """kill -9 of a driver that started a local Ray: what its processes started lives on (Ray's
    agents did, for minutes); the watcher it starts with the local Ray (launch.runtime.reaper) ends every
    descendant of the driver, and nothing else. Here a driver's child and grandchild stand for
    Ray's processes and the agents under the raylet."""
    import signal

    import psutil

    script = (
        "import subprocess, sys, time\n"
        "from raytrain_hybrid.launch.runtime import reaper\n"
        "reaper.start()\n"
        "child = subprocess.Popen(['sh', '-c', 'sleep 300 & echo $!; wait'], stdout=subprocess.PIPE, text=True)\n"
        "print(child.pid, child.stdout.readline().strip(), flush=True)\n"
        "time.sleep(300)\n"
    )
    bystander = subprocess.Popen(["sleep", "300"])
    fake = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in fake.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        # The watcher's looks, which a loaded machine delays (a fixed 0.6 s once passed before the
        # watcher had started): up, psutil imported, waiting on the pipe (a look before each wait),
        # then a second wait's length (0.25 s) more, so that one look followed the child's start.
        watcher = next(p for p in psutil.Process(fake.pid).children() if "reaper.py" in " ".join(p.cmdline()))
        deadline = time.time() + 60
        while not (_mapped(watcher, "_psutil_linux") and watcher.status() == psutil.STATUS_SLEEPING):
            assert time.time() < deadline, "the watcher did not start within 60 s"
            time.sleep(0.05)
        time.sleep(1.0)
        fake.send_signal(signal.SIGKILL)
        fake.wait()
        deadline = time.time() + 10
        while time.time() < deadline and any(_running(p) for p in pids):
            time.sleep(0.1)
        assert not any(_running(p) for p in pids), [psutil.Process(p).cmdline() for p in pids if _running(p)]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        for pid in pids if "pids" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _mapped(proc, name: str) -> bool:
    """Whether ``proc`` has a library with ``name`` in its path loaded (an import done)."""
    return any(name in m.path for m in proc.memory_maps(grouped=True))


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _session(sid: int) -> list[int]:
    """The processes of a session this test started: a CLI run and the local Ray it started."""
    import psutil

    return [p.pid for p in psutil.process_iter() if _sid(p.pid) == sid]


def psutil_cmdline(pid: int) -> str:
    import psutil

    with contextlib.suppress(psutil.Error):
        return " ".join(psutil.Process(pid).cmdline())[:200]
    return f"{pid} (gone)"


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_a_ray_run_whose_lease_is_taken_over_stops_writing_and_ends_saying_so(tmp_path):
    """From the user's side: `train` on Ray (a local Ray of its own) is stalled whole (SIGSTOP of
    its session: a suspended machine, a driver cut off) for longer than its lease lives, and
    `train --resume` of its directory, under torchrun, takes the lease over and trains on. The
    stalled run, woken, stops at once: exit 1 naming the run that took the directory, no process of
    its own left, no checkpoint of its own completed after the takeover, and summary.json and
    metrics.jsonl are the other run's, every step recorded once."""
    import signal

    out = tmp_path / "run"
    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_len=32",
            "train.global_batch_size=4", "parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1",
            "parallelism.microbatches=1", "data.path=memory", "train.steps=30", f"run.output_dir={out}"]  # fmt: skip
    sets = [a for kv in tiny for a in ("--set", kv)]
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, stalled with it
    first = subprocess.Popen(
        [str(bin_dir / "raytrain-hybrid"), "train", *sets, "--set", "checkpoint.interval=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    second = None
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "step_2" / "manifest.json").exists():
            assert first.poll() is None and time.time() < deadline, first.communicate(timeout=60)
            time.sleep(0.05)
        stalled = _session(first.pid)
        for pid in stalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        ours = json.loads((out / LEASE).read_text())
        before = {p.name: json.loads((p / "manifest.json").read_text())["launch_id"]
                  for p in (out / "checkpoints").glob("step_*") if (p / "manifest.json").exists()}  # fmt: skip
        # Its lease lives 120 s after a renewal: the stall that long is the renewal moved back.
        (out / "stale").write_text(json.dumps({**ours, "renewed_at": ours["renewed_at"] - 1000}))
        os.replace(out / "stale", out / LEASE)
        second = subprocess.Popen(
            [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "1", "-m", "raytrain_hybrid.cli", "train",
             "--resume", str(out), *sets, "--set", "checkpoint.interval=10"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        while json.loads((out / LEASE).read_text())["holder"]["token"] == ours["holder"]["token"]:
            assert second.poll() is None and time.time() < deadline, second.communicate(timeout=60)
            time.sleep(0.05)
        for pid in stalled:  # taken over: the first run wakes up
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        _, err = first.communicate(timeout=120)
        assert first.returncode == 1, err
        assert f"error: run.output_dir={out} was taken over by another run (host {socket.gethostname()}" in err, err
        assert "Traceback" not in err, err
        gone = time.time() + 30  # and it leaves no process of its own (its local Ray included)
        while _session(first.pid) and time.time() < gone:
            time.sleep(0.2)
        assert not _session(first.pid), [psutil_cmdline(p) for p in _session(first.pid)]
        second_out, second_err = second.communicate(timeout=300)
        assert second.returncode == 0, second_err[-3000:]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for pid in _session(first.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    launch = set(before.values())
    after = {p.name: json.loads((p / "manifest.json").read_text())["launch_id"]
             for p in (out / "checkpoints").glob("step_*") if (p / "manifest.json").exists()}  # fmt: skip
    assert {n for n, who in after.items() if who in launch} <= set(before), (before, after)  # none completed after
    assert "step_30" in after and after["step_30"] not in launch
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(30))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and "steps_unrecorded" not in summary and not (out / LEASE).exists()
