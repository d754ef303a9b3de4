"""`ray job submit` as a user runs it: a real head started with `ray start --head` on loopback,
the documented runtime environment and entrypoint, then status, logs and outputs. The head
has an S3 endpoint (moto's server on loopback) in its environment, as a cloud node has its
credentials: a job that fails mid-way continues when resubmitted with --resume s3://...
The head and its jobs run beside the suite's other tests (tests/background.py)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow.fs as pafs
import pytest
from background import on_stop
from background import result as background_result
from job_server import answers, call, free_port, submitted
from s3_server import KEY_ID, SECRET, fresh_buckets

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@contextlib.contextmanager
def ray_head(workdir: Path, env: dict):
    """A head in its own process group (ended by that group, never a machine-wide `ray stop`),
    with token authentication as Ray turns it on, the venv first on PATH as after `source
    .venv/bin/activate`."""
    tmp = Path(tempfile.mkdtemp(prefix="rh"))  # short: Ray's socket paths live under it
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    env = {
        **env,
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        # On SIGTERM the head would ask the GCS (ended by the same signal) to drain the node
        # and wait up to 30 s for it: the teardown below would wait out its 10 s every time.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    env.pop("RAY_ADDRESS", None)
    for attempt in (1, 2):  # a free port may be taken by another Ray of the suite before the head binds it
        dash = free_port()
        cmd = [
            str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=10", f"--port={free_port()}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={free_port()}",
            f"--temp-dir={tmp / f'ray{attempt}'}", "--disable-usage-stats",
            # The session's own cluster holds the default agent ports on this machine; a second
            # head's job agent could not bind them ("No available agent to submit job").
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
        ]  # fmt: skip
        log = (tmp / "head.log").open("w")
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        on_stop(functools.partial(_kill_group, head.pid))
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 120
        # First the dashboard's HTTP port, then a job it takes.
        while head.poll() is None and time.time() < deadline and not answers(f"{address}/api/version"):
            time.sleep(0.5)
        while True:
            # Ready when a job can be submitted: the dashboard answers before its job agent does
            # ("No available agent to submit job").
            taken, why = submitted(address, token.read_text(), {"entrypoint": "echo ready"}, timeout=60)
            if taken or head.poll() is not None or time.time() > deadline:
                break
            time.sleep(2)
        if taken:
            break
        _kill_group(head.pid)  # the head may have exited by itself
        head.wait()
        log.close()
        said = (tmp / "head.log").read_text()[-3000:]
        if attempt == 2:
            raise RuntimeError(f"ray head did not take a job: {why[-3000:]}\nhead: {said}")
    try:
        yield {"address": address, "env": env, "tmp": tmp, "pid": head.pid}
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_group(head.pid)
            head.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _ray(head, *args, timeout=600):
    return subprocess.run(
        [str(BIN / "ray"), *args], cwd=ROOT, env=head["env"], capture_output=True, text=True, timeout=timeout
    )


def _submit(head, job_id: str, *train_args: str, wait: bool = True):
    # The documented line (jobs/README.md), with a known id and the outputs kept outside the
    # working directory copy.
    return _ray(
        head, "job", "submit", "--address", head["address"], "--submission-id", job_id,
        *([] if wait else ["--no-wait"]), "--working-dir", ".", "--runtime-env", "jobs/runtime_env_local.yaml",
        "--", "python", "-m", "raytrain_hybrid.cli", "train", "jobs/local_3d.toml", *train_args,
    )  # fmt: skip


REFUSED = {
    "rh-bad": ["parallelism.tp=3"],
    # 10 workers on the 10-CPU head would leave Ray Data's reads waiting forever. An output
    # directory of its own: the job file's is the stuck job's, whose run holds its lease for 45 s
    # (on a loaded machine this job's CPU check once came after that lease, and was refused by it).
    "rh-cpus": ["parallelism.dp=5", "parallelism.pp=1", "parallelism.microbatches=1", "train.global_batch_size=20",
                "run.output_dir=runs/rh-cpus"],
    # 12 workers cannot be placed on 10 CPUs (an autoscaler might add nodes, so no refusal up
    # front). run.shared_fs: the group may wait for nodes still to come, so a local output
    # directory is refused up front unless every node shares it (here they would: one machine).
    # 45 s: beside another job's workers starting, the controller may take 15 s to ask for the group.
    "rh-stuck": ["parallelism.dp=6", "parallelism.pp=1", "parallelism.microbatches=1", "train.global_batch_size=24",
                 "run.startup_timeout_s=45", "run.shared_fs=true"],
}  # fmt: skip


def submit_refused(head) -> dict[str, subprocess.Popen]:
    """The jobs that must fail, submitted together at the start and left running beside the
    other jobs (their drivers mostly wait: on imports, on the 45 s watchdog)."""
    argv = [str(BIN / "ray"), "job", "submit", "--address", head["address"], "--working-dir", ".",
            "--runtime-env", "jobs/runtime_env_local.yaml"]  # fmt: skip
    entry = ["--", "python", "-m", "raytrain_hybrid.cli", "train", "jobs/local_3d.toml"]
    procs = {}
    for job_id, sets in REFUSED.items():  # as _submit, each `ray job submit` waiting for its job's end
        cmd = [*argv, "--submission-id", job_id, *entry, *[a for kv in sets for a in ("--set", kv)]]
        procs[job_id] = subprocess.Popen(
            cmd, cwd=ROOT, env=head["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return procs


def _api(head, path: str):
    """The head's job server over HTTP (tests/job_server.py); jobs are submitted with `ray job submit`."""
    return call(head["address"], Path(head["env"]["RAY_AUTH_TOKEN_PATH"]).read_text(), path)


def _logs(head, job_id: str) -> str:
    return _api(head, f"/api/jobs/{job_id}/logs")["logs"]


def _status(head, job_id: str) -> str:
    return _api(head, f"/api/jobs/{job_id}")["status"]


def _wait_for(what, timeout: float = 600, every: float = 0.2, job: tuple | None = None):
    """``what()`` once true. ``job``: (head, job id) whose end means it never will be, looked at every
    15 s by a thread of its own; a failure then says the job's status and logs and the
    head's jobs (a wait for the cut job's first checkpoint once timed out after 600 s, saying
    nothing more)."""
    ended, done = threading.Event(), threading.Event()

    def watch():
        while not done.wait(15):
            if _ended(*job):
                ended.set()
                return

    if job:
        threading.Thread(target=watch, daemon=True).start()
    deadline = time.time() + timeout
    try:
        while not (found := what()):
            if ended.is_set() or time.time() > deadline:
                state = _job_state(*job) if job else ""
                raise AssertionError(
                    f"{'the job ended' if ended.is_set() else 'timed out'} waiting for {what}: {state}"
                )
            time.sleep(every)
    finally:
        done.set()
    return found


def _job_state(head, job_id: str) -> str:
    listed = [(j["submission_id"], j["status"], j.get("message")) for j in _api(head, "/api/jobs/")]
    return f"{_status(head, job_id)}\nlogs: {_logs(head, job_id)[-3000:]}\nthe head's jobs: {listed}"


def _ended(head, job_id: str) -> str:
    """The job's status once it has ended (FAILED, SUCCEEDED, STOPPED), else ""."""
    status = _status(head, job_id)
    return "" if status in ("PENDING", "RUNNING") else status


def _train_workers(head) -> list[psutil.Process]:
    """The head's training worker processes (children of its raylet), none of another Ray."""
    found = []
    for proc in psutil.Process(head["pid"]).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.cmdline()).startswith("ray::RayTrainWorker"):
                found.append(proc)
    return found


def _bucket(fs, prefix: str) -> dict[str, bytes]:
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(prefix, recursive=True)):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                out[info.path.removeprefix(prefix + "/")] = f.read()
    return out


# The job cut short and resubmitted: its settings, and the layout it first runs at.
CUT = ["train.steps=6", "checkpoint.interval=2", "data.path=memory", "run.max_failures=0",
       "run.output_dir=s3://jobs/cut"]  # fmt: skip
SMALL = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2"]


def background(workdir: Path, env: dict, cases: set[str] | None = None) -> dict:
    """Every job of this file on one head of its own, beside the suite's other tests
    (tests/background.py), its S3 output in a bucket of its own: the jobs that must fail
    submitted first and left running; meanwhile the job at (1,1,2) loses a worker after its first
    checkpoint, fails, and is resubmitted with --resume. Returns what the tests look at."""
    s3_env = fresh_buckets("jobs")
    s3 = pafs.S3FileSystem(
        endpoint_override=s3_env["AWS_ENDPOINT_URL"], access_key=KEY_ID, secret_key=SECRET, region="us-east-1"
    )
    out: dict = {}
    with ray_head(workdir, {**env, **s3_env}) as head:
        refused = submit_refused(head)
        try:
            args = [a for kv in CUT for a in ("--set", kv)]
            out["cut_submitted"] = _submit(
                head, "rh-cut", *args, *[a for kv in SMALL for a in ("--set", kv)], wait=False
            )
            if out["cut_submitted"].returncode == 0:
                cut = (head, "rh-cut")
                # The worker to kill is found first, so that it dies within a fraction of a second of
                # the first checkpoint: the tiny run reaches its last (step 6) in seconds.
                victim = _wait_for(lambda: _train_workers(head), job=cut)[0]
                _wait_for(lambda: s3.get_file_info("jobs/cut/checkpoints/step_2/manifest.json").size, 600, 0.05, cut)
                victim.kill()
                out["cut_status"] = _wait_for(lambda: _ended(head, "rh-cut"), every=1)
                out["cut_logs"] = _logs(head, "rh-cut")
                out["cut_bucket"] = sorted(_bucket(s3, "jobs/cut"))
                out["resume"] = _submit(
                    head, "rh-resume", *args, "--set", "parallelism.dp=1", "--resume", "s3://jobs/cut"
                )
                out["resume_logs"] = _logs(head, "rh-resume")
                out["resume_status"] = _status(head, "rh-resume")
                out["listed"] = [j["submission_id"] for j in _api(head, "/api/jobs/")]  # the dashboard's list
                out["objects"] = _bucket(s3, "jobs/cut")
            for job_id, proc in refused.items():
                stdout, _ = proc.communicate(timeout=600)
                out[job_id] = {
                    "returncode": proc.returncode,
                    "status": _status(head, job_id),
                    "logs": _logs(head, job_id),
                }
        finally:
            for proc in refused.values():
                proc.kill()
    return out


@pytest.fixture(scope="module")
def jobs() -> dict:
    return background_result("test_jobs_ray", background)


@pytest.mark.slow
def test_a_failed_job_resubmitted_with_resume_continues_under_another_layout(jobs):
    """The job at (1,1,2) loses a worker after its first checkpoint with no restart allowed and
    fails; the same job resubmitted with --resume <its output URI> at (1,2,2) (the job file's
    tp and pp, dp=1: 4 workers) continues in place to the full step count and reports: every
    step's loss and gradient norm is the uninterrupted single-process run's, each step once in
    the bucket's metrics.jsonl. (The jobs that must fail ran meanwhile.)"""
    from reference import reference_run

    from raytrain_hybrid.config import load_config

    assert jobs["cut_submitted"].returncode == 0, jobs["cut_submitted"].stderr[-2000:]
    assert jobs["cut_status"] == "FAILED", jobs["cut_status"]
    assert "error: training failed" in jobs["cut_logs"]
    cut = jobs["cut_bucket"]
    assert "checkpoints/step_6/manifest.json" not in cut and "metrics.jsonl" in cut, cut

    done, logs = jobs["resume"], jobs["resume_logs"]
    assert done.returncode == 0 and "succeeded" in done.stdout, logs[-3000:]
    assert "step 6/6" in logs and "done: 6 steps" in logs, logs[-3000:]
    assert "newest checkpoint s3://jobs/cut/checkpoints/step_6" in logs, logs[-2000:]
    assert jobs["resume_status"] == "SUCCEEDED", jobs["resume_status"]
    assert "rh-resume" in jobs["listed"] and "rh-cut" in jobs["listed"]
    want = reference_run(load_config(ROOT / "jobs" / "local_3d.toml", CUT))
    objects = jobs["objects"]
    history = [json.loads(line) for line in objects["metrics.jsonl"].decode().splitlines()]
    assert [h["step"] for h in history] == list(range(6))
    for got, ref in zip(history, want, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), f"loss at step {ref['step']}"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), f"grad_norm at step {ref['step']}"
    summary = json.loads(objects["summary.json"])
    assert summary["steps"] == 6 and summary["world_size"] == 4
    assert summary["layout"] | {"dp": 1, "tp": 2, "pp": 2} == summary["layout"]
    assert any(name.startswith("tensorboard/events.out.tfevents.") for name in objects), sorted(objects)
    for name, data in objects.items():
        assert KEY_ID.encode() not in data and SECRET.encode() not in data, name


def _failed(jobs, job_id: str) -> str:
    """The logs of a job whose `ray job submit` exited non-zero and whose status says failed."""
    job = jobs[job_id]
    assert job["returncode"] != 0
    assert job["status"] == "FAILED", job["status"]
    return job["logs"]


def test_a_failing_job_exits_non_zero_with_the_reason(jobs):
    logs = _failed(jobs, "rh-bad")
    assert "parallelism.tp=3: does not divide model.num_heads=4" in logs, logs[-2000:]


def test_a_job_whose_workers_take_every_cpu_is_refused(jobs):
    """10 workers on the 10-CPU head: refused, with the CPUs there and the CPUs needed."""
    logs = _failed(jobs, "rh-cpus")
    assert "the cluster has 10 CPUs and 10 workers take 10 of them" in logs, logs[-2000:]
    assert "ray start --head --num-cpus=11" in logs


def test_a_job_that_cannot_start_stops_and_says_what_ray_waits_for(jobs):
    """12 workers on 10 CPUs: the start-up watchdog ends the job and names the pending placement group."""
    logs = _failed(jobs, "rh-stuck")
    assert "no training step after 45 s (run.startup_timeout_s)" in logs, logs[-2000:]
    assert "Ray is waiting for: placement group of 12 x {'CPU': 1.0}" in logs
