"""`check` prints the run plan `train`'s driver makes (launch.runtime.start.derive_plan), without starting
anything: the same start line, the output directory's lease as it stands (read, never taken),
and with --resume the driver's own resume check, refusing what `train --resume` refuses. No Ray:
the nodes come from --topology, and the driver's plan is made for the same nodes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from s3_server import s3_server

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.launch.plan.reach import Reach
from raytrain_hybrid.launch.records.lease import LEASE, acquire

# Two nodes: run.output_dir must be storage both reach (a shared mount here).
FIXED = ("parallelism.dp=1", "parallelism.tp=4", "parallelism.pp=2", "data.path=memory", "run.shared_fs=true")
ONE_NODE = FIXED[:-1]  # run.output_dir where it is (object storage, or this node's disk for one node)
ELASTIC = (
    "parallelism.dp=4",
    "parallelism.min_dp=1",
    "parallelism.tp=2",
    "parallelism.pp=1",
    "parallelism.microbatches=3",
    "train.global_batch_size=24",
    "data.path=memory",
)


def _check(capsys, out, sets, *extra) -> tuple[int, str, str]:
    argv = ["check", *extra, *(a for s in (*sets, f"run.output_dir={out}") for a in ("--set", s))]
    code = cli.main(argv)
    got = capsys.readouterr()
    return code, got.out, got.err


def _start_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith("start: ")]
    return line


@pytest.mark.parametrize(
    "sets, topology, line",
    [
        (FIXED, "4,4", "dp=1 tp=4 pp=2, 8 workers (1 CPU, 1 GPU each) on nodes holding [4, 4]; 20 steps; output {}"),
        (ELASTIC, "8", "dp=4 tp=2 pp=1, 2 to 8 workers (1 CPU, 1 GPU each) on nodes holding [8]; 20 steps; output {}"),
    ],
    ids=["fixed", "elastic"],
)
def test_check_prints_the_drivers_start_line(sets, topology, line, tmp_path, capsys, monkeypatch):
    """The line check prints is the one the driver says for the same config on the same nodes
    (one GPU a worker: --topology counts GPU workers unless cluster.use_gpu=false); check makes
    neither the output directory nor a lease."""
    from raytrain_hybrid.launch.runtime import start

    out = tmp_path / "run"
    code, text, err = _check(capsys, out, sets, "--topology", topology)
    assert code == 0, err
    shown = _start_line(text)
    where = "a shared mount" if "run.shared_fs=true" in sets else "this node's disk"
    assert shown == f"start: {line.format(out)} ({where}); from step 0", shown
    assert "lease: free" in text.splitlines() and not out.exists()
    if "parallelism.min_dp=1" in sets:  # the driver's elastic line, as it says it
        assert any(s.startswith("elastic: dp between 1 and 4, at one of [1, 2, 3, 4]") for s in text.splitlines())
    checked = json.loads(_check(capsys, out, sets, "--topology", topology, "--json")[1])["plan"]
    # The driver's plan for nodes holding those workers: Ray's totals of each node, a GPU a worker.
    nodes = [{"CPU": float(n), "GPU": float(n)} for n in map(int, topology.split(","))]
    asked = load_config(None, [*sets, f"run.output_dir={out}"])
    said: list[str] = []
    cfg, point = start.prepare_run_dir(asked, None)
    cfg, data = start.check_before_ray(cfg, said.append)
    monkeypatch.setattr(start, "run_nodes", lambda cfg: Reach(nodes))
    plan = start.plan_run(cfg, point, said.append, data=data, asked=asked)
    assert plan.lines() == [shown] and not out.exists()  # planned before Ray starts, nothing made yet
    assert all(line in text.splitlines() for line in said)  # and check printed what else it said
    # check --json's plan is the one train runs, but for what only a run has: its lease, taken, and the
    # trajectory its checkpoints record (check reads no data to digest it).
    ran = json.loads(json.dumps(plan.to_json()))
    assert (checked.pop("lease"), ran.pop("lease")) == ("free", "held by this run")
    assert checked["worker_plan"].pop("trajectory") == {} and ran["worker_plan"].pop("trajectory")
    assert checked == ran
    assert ran["worker_plan"]["cfg"] == cfg.to_dict() and asked.run.output_dir == str(out)


def test_train_hands_every_worker_the_plan_read_only(tmp_path, monkeypatch):
    """The TorchTrainer's train_loop_config is the plan as workers get it (frozen), the driver's
    event queue and tracker run beside it: no other key."""
    import dataclasses

    from raytrain_hybrid.launch.runtime import driver, start

    asked = load_config(None, [*ONE_NODE, "checkpoint.interval=2", f"run.output_dir={tmp_path / 'run'}"])
    cfg, point = start.prepare_run_dir(asked, None)
    monkeypatch.setattr(start, "run_nodes", lambda cfg: Reach([{"CPU": 8.0}]))
    plan = start.plan_run(cfg, point, data=start.check_before_ray(cfg)[1], asked=asked)
    got = {}
    monkeypatch.setattr(driver, "make_torch_trainer", lambda plan, **kw: got.update(kw))
    driver.make_trainer(plan, sink="queue")
    loop = got["train_loop_config"]
    assert set(loop) == {"plan", "sink", "tracking"} and loop["sink"] == "queue" and loop["tracking"] is None
    given = loop["plan"]
    assert given == plan.for_workers() and given.cfg is plan.cfg and given.launch_id == plan.launch_id
    assert (given.use_gpu, given.end, given.resume, given.data_origin) == (False, 20, None, 0)
    assert given.trajectory == point.trajectory and given.cfg.run.output_dir == str(tmp_path / "run")
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.resume = "elsewhere"
    assert got["scaling_config"].num_workers == 8 and got["scaling_config"].resources_per_worker == plan.resources
    # An elastic run: Ray Train is asked for the plan's range of worker counts.
    asked = load_config(None, [*ELASTIC, f"run.output_dir={tmp_path / 'elastic'}"])
    cfg, point = start.prepare_run_dir(asked, None)
    monkeypatch.setattr(start, "run_nodes", lambda cfg: Reach([{"CPU": 16.0}]))
    plan = start.plan_run(cfg, point, data=start.check_before_ray(cfg)[1], asked=asked)
    driver.make_trainer(plan, sink="queue")
    assert plan.counts == [2, 4, 6, 8] and got["scaling_config"].num_workers == (2, 8)


def test_check_json_keeps_its_keys_and_adds_the_start(tmp_path, capsys):
    out = tmp_path / "run"
    code, text, err = _check(capsys, out, ELASTIC, "--topology", "8", "--json")
    assert code == 0, err
    got = json.loads(text)
    assert set(got) == {"ranks", "groups", "totals", "dp_values", "start", "plan"} and got["dp_values"] == [1, 2, 3, 4]
    assert len(got["ranks"]) == 8 and got["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    start = got["start"]
    assert start["line"] == _start_line(_check(capsys, out, ELASTIC, "--topology", "8")[1])  # the text's line
    assert (start["dp"], start["tp"], start["pp"], start["workers"]) == (4, 2, 1, [2, 4, 6, 8])
    assert start["resources"] == {"CPU": 1.0, "GPU": 1} and start["placement"] == [8] and start["steps"] == 20
    assert (start["output"], start["output_store"], start["lease"]) == (str(out), "this node's disk", "free")
    assert start["resume"] is None and start["live_nodes"] == 1 and not out.exists()
    plan = got["plan"]  # the whole RunPlan: the start's facts, and what each worker is given
    assert {k: plan[k] for k in start if k != "line"} == {k: v for k, v in start.items() if k != "line"}
    assert plan["unverified"] == [] and plan["resolved"] == {}  # run.output_dir given absolute, data in memory
    worker = plan["worker_plan"]
    assert worker["cfg"]["parallelism"]["min_dp"] == 1 and worker["cfg"]["run"]["output_dir"] == str(out)
    assert (worker["end"], worker["resume"], worker["use_gpu"], worker["layout_hardware"]) == (20, None, True, None)
    # On two nodes, a directory on this node's disk is what train refuses: said, not refused.
    code, text, err = _check(capsys, out, (*FIXED, "run.shared_fs=false"), "--topology", "4,4")
    assert code == 0 and "(this node's disk); from step 0" in _start_line(text)
    assert (
        f"warning: train refuses this on these nodes: run.output_dir='{out}': is a directory on this node's disk"
        in text
    )


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        yield env


@pytest.mark.parametrize("where", ["local", "s3"])
def test_check_refuses_a_directory_another_run_holds_leaving_its_lease(where, request, tmp_path, capsys, monkeypatch):
    """On this node's disk and on the S3 server (the lease's conditional writes there)."""
    from raytrain_hybrid.storage import open_store

    out = str(tmp_path / "run") if where == "local" else f"s3://bucket/{tmp_path.name}/run"
    if where == "s3":
        request.getfixturevalue("s3")

    monkeypatch.setenv("RAY_JOB_SUBMISSION_ID", "raysubmit_holder")
    holder = acquire(out)
    lease = open_store(out).child(LEASE)
    before = lease.read_bytes()
    try:
        code, text, err = _check(capsys, out, ONE_NODE, "--topology", "8")
        assert code == 2, err  # train's refusal, said as train says it
        assert err.startswith(
            f"error: run.output_dir='{out}': is in use by another run (host {socket.gethostname()}, "
            f"process {os.getpid()}, started "
        ), err
        assert "job raysubmit_holder" in err and "Wait for it to end, or choose another run.output_dir" in err
        assert lease.read_bytes() == before and open_store(out).listdir() == [LEASE]
    finally:
        holder.release()
    # A holder that is gone (its process, on this host) leaves a lease the next run takes over.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = {"host": socket.gethostname(), "pid": int(dead.stdout), "started_at": "x", "job": "", "token": "t"}
    lease.write_text(json.dumps({"holder": gone, "renewed_at": time.time(), "ttl_s": 120}))
    code, text, _ = _check(capsys, out, ONE_NODE, "--topology", "8")
    assert code == 0 and f"lease: free (the lease of a run that is gone has expired: host {gone['host']}" in text
    if out.startswith("s3://"):
        assert f"output {out} (object storage); from step 0" in _start_line(text)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory holding one checkpoint (step 2) as the driver's checks read it: a real DCP
    directory of the model's state and its manifest, recording the trajectory of train.lr=0.0003."""
    import torch.distributed.checkpoint as dcp
    from fuzz_files import training_state

    from raytrain_hybrid.checkpoint.manifest import FORMAT, MANIFEST, file_digest, layout_of
    from raytrain_hybrid.checkpoint.trajectory import describe

    run = tmp_path_factory.mktemp("saved") / "run"
    step = run / "checkpoints" / "step_2"
    cfg = load_config(None, [*FIXED, "train.lr=0.0003", f"run.output_dir={run}"])
    dcp.save(training_state(cfg), checkpoint_id=str(step), no_dist=True)
    files = {p.name: file_digest(p) for p in step.iterdir()}
    manifest = {"format": FORMAT, "step": 2, "launch_id": "a", "world_size": 8, "layout": layout_of(cfg),
                "config": cfg.to_dict(), "data_position": {}, "files": files, "trajectory": describe(cfg)}  # fmt: skip
    (step / MANIFEST).write_text(json.dumps(manifest))
    return run


def test_check_resume_refuses_a_changed_trajectory_as_train_does(saved, tmp_path, capsys):
    target = tmp_path / "r"
    sets = (*FIXED, "train.lr=0.01")
    code, _, err = _check(capsys, target, sets, "--topology", "4,4", "--resume", str(saved))
    assert code == 2, err
    assert err.startswith("error: train.lr=0.01: the checkpoint ") and "was trained with train.lr=0.0003; " in err
    assert "--allow-change train.lr" in err and not target.exists()
    # train --resume refuses it with the same words, before Ray starts.
    argv = ["train", "--resume", str(saved), *(a for s in (*sets, f"run.output_dir={target}") for a in ("--set", s))]
    assert cli.main(argv) == 2 and capsys.readouterr().err == err
    # Allowed, the start line says where the run starts; check wrote nothing anywhere.
    before = sorted(p.relative_to(saved) for p in saved.rglob("*"))
    code, text, err = _check(
        capsys, target, sets, "--topology", "4,4", "--resume", str(saved), "--allow-change", "train.lr"
    )
    assert code == 0, err
    assert "resume: train.lr differs from the checkpoint's (allowed by --allow-change)" in text
    assert _start_line(text).endswith(f"; resumed from {saved}/checkpoints/step_2 at step 2")
    assert not target.exists() and sorted(p.relative_to(saved) for p in saved.rglob("*")) == before


def test_check_refuses_a_directory_holding_an_earlier_runs_checkpoints(saved, capsys):
    """As `train` without --resume: the earlier run's checkpoints would be overwritten."""
    code, _, err = _check(capsys, saved, (*FIXED, "train.lr=0.0003"), "--topology", "4,4")
    assert code == 2 and "holds checkpoints of an earlier run (step_2); continue it with --resume" in err, err
    code, text, err = _check(capsys, saved, (*FIXED, "train.lr=0.0003"), "--topology", "4,4", "--resume", str(saved))
    assert code == 0 and _start_line(text).endswith(
        "resumed from " + str(saved / "checkpoints" / "step_2") + " at step 2"
    )


def test_check_of_a_bucket_it_cannot_reach_says_so_and_shows_the_plan(tmp_path, capsys, monkeypatch):
    """Offline, pyarrow opening s3://bucket asks AWS for the bucket's region and fails (an OSError):
    check says what it could not verify and still prints the layout and the start line."""
    import pyarrow.fs as pafs

    import raytrain_hybrid.storage as storage

    class Offline:  # pyarrow.fs as the storage layer sees it, with no network
        def __getattr__(self, name):
            return getattr(pafs, name)

        class FileSystem:
            @staticmethod
            def from_uri(uri):
                if uri.startswith("s3://"):
                    raise OSError("When resolving region for bucket 'mybucket': Could not resolve hostname")
                return pafs.FileSystem.from_uri(uri)

    monkeypatch.setattr(storage, "pafs", Offline())
    code, text, err = _check(capsys, "s3://mybucket/runs/x", ONE_NODE, "--topology", "8")
    assert code == 0, err
    assert "not verified: run.output_dir='s3://mybucket/runs/x' could not be read here (When resolving region" in text
    assert "output s3://mybucket/runs/x (object storage); from step 0" in _start_line(text)
    assert "lease: not checked (run.output_dir could not be read here)" in text
    assert "warning: train refuses" not in text
    # A location pyarrow cannot parse at all is still refused, naming the key.
    code, _, err = _check(capsys, "nosuchscheme://x/y", ONE_NODE, "--topology", "8")
    assert code == 2 and err.startswith("error: run.output_dir='nosuchscheme://x/y': is not a location"), err
