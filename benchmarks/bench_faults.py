"""Fault-injection campaign: kill -9 across checkpoint saves, restart, and check nothing was lost.

    nice -n 10 .venv/bin/python benchmarks/bench_faults.py [--trials 55] [--seed 0] [--kinds local,s3]

Each trial (tests/fault_trial.py) trains a tiny Llama for 5 steps on 2 gloo ranks (dp=2, ZeRO-1),
a checkpoint after every step, written in the background (checkpoint.async_save; a quarter of the
trials in the foreground), to (a) a local directory or (b) the S3 server on loopback (moto, as
tests/s3_server.py starts it, behind a TCP proxy that can die). A seeded fault fires in the save of
a seeded step (tests/fault_injection.py has the points, and how a run's driver is modelled without
Ray): SIGKILL of a worker, or of the driver with its whole job, at a random instant of the save or
at a sampled point of its path (DCP's write of a shard, .metadata, hashing, the upload, the
manifest, the directory fsync, the rename); on S3 also the endpoint killed and restarted
mid-upload. Then the run restarts as ``train --resume <run dir>`` does (the driver's checks: the
newest intact checkpoint, the trajectory, the lease) and trains to the end.

Figures per storage kind: faults injected, runs restarted and ended, runs whose every loss after
the restart equals the uninterrupted run's (same config, computed once), checkpoints lost (complete
when the fault fired but not intact after it or at the end), user files changed. Writes
benchmarks/results/faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import fault_injection as fi  # noqa: E402
import fault_proxy  # noqa: E402
import fault_trial as ft  # noqa: E402

from raytrain_hybrid.storage import open_store  # noqa: E402


def summarize(rows: list[dict]) -> dict:
    fired = [r for r in rows if r["fired"]]
    restarted = [r for r in fired if r["restart"]]
    return {
        "trials": len(rows),
        "faults_injected": len(fired),
        "faults_that_never_fired": len(rows) - len(fired),
        "runs_killed_or_failed": sum(r["first_run"] != "ok" for r in fired),
        "ran_on_through_the_fault": sum(r["first_run"] == "ok" for r in fired),
        "restarted": len(restarted),
        "resumed_from_a_checkpoint": sum(r["restart"] == "resume" for r in restarted),
        "started_again_no_checkpoint_yet": sum(r["restart"] == "fresh" for r in restarted),
        "restarted_and_trained_to_the_end": sum(r.get("second_run") == "ok" for r in restarted),
        "nothing_left_to_train_last_checkpoint_complete": sum(r["restart"] == "none_left" for r in restarted),
        "runs_whose_every_loss_equals_the_uninterrupted_run": sum(r["losses_equal"] is True for r in fired),
        "runs_whose_losses_differ_or_did_not_end": sum(r["losses_equal"] is False for r in fired),
        "checkpoints_complete_when_the_fault_fired": sum(len(r["complete_when_fired"]) for r in fired),
        "checkpoints_lost": sum(len(r["checkpoints_lost"]) for r in fired),
        "resumed_from_older_than_the_newest_complete": sum(r["resumed_from_newest_complete"] is False for r in fired),
        "user_files_changed": sum(r["user_files_changed"] for r in fired),
        # Object storage: a killed save's staging on the node is never deleted (the restart's is another launch's).
        "trials_leaving_local_staging_behind": sum(bool(r.get("staging_left_bytes")) for r in fired),
        "local_staging_left_bytes": sum(r.get("staging_left_bytes", 0) for r in fired),
        "by_point": _count(r["fault"]["point"] for r in fired),
        "by_phase_when_fired": _count(r["fired_in"]["phase"] for r in fired),
        "by_target": _count(r["fault"]["target"] for r in fired),
    }


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items()))


def campaign(kind: str, args, ctx, base: Path) -> dict:

    proxy, env = None, {}
    if kind == "s3":
        from s3_server import fresh_buckets

        moto = fresh_buckets("faults")
        os.environ.update(moto)  # this process checks the bucket through moto itself
        proxy = fault_proxy.Proxy(int(moto["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
        env = {**moto, "AWS_ENDPOINT_URL": proxy.url}  # the runs go through the proxy
    rng = random.Random(f"{args.seed}-{kind}")
    calib = ft.reference(ctx, kind, base / kind / "reference", env, proxy)
    print(f"{kind}: reference losses {calib['losses']}, save_s {calib['save_s']:.2f}", flush=True)
    rows = []
    for i in range(args.trials):
        fault = ft.sample_fault(rng, kind, calib)
        sync = rng.random() < 0.25
        trial = base / kind / f"t{i:03d}"
        row = ft.trial(ctx, kind, trial, fault, calib, env, proxy=proxy, sync=sync)
        bad = row["checkpoints_lost"] or row["losses_equal"] is False or row["user_files_changed"]
        if bad:  # kept for a look
            row["kept_at"] = ft.run_dir(kind, trial)
        else:
            if kind == "s3":
                open_store(ft.run_dir(kind, trial)).parent.delete()
            shutil.rmtree(trial, ignore_errors=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"summary": summarize(rows), "reference": calib, "trials": rows}
    if proxy is not None:
        out["endpoint_restarts"] = proxy.restarts
        proxy.stop()
    return out


# ------------------------------------------------------------------ a few trials through the CLI, with Ray


def _session_pids(sid: int) -> list[int]:
    """The processes of a session this benchmark started (the CLI and the local Ray it started)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout.split()
    return [int(p) for p, s in zip(out[::2], out[1::2], strict=True) if int(s) == sid]


def _end_session(proc: subprocess.Popen, grace: float = 0.0) -> None:
    time.sleep(grace)
    for pid in _session_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _train(out: Path, extra: list[str], log: Path) -> subprocess.Popen:
    sets = [a for kv in [*ft.overrides(str(out)), "data.path=memory", "checkpoint.keep=2", "run.max_failures=1"]
            for a in ("--set", kv)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private local Ray
    cmd = [str(HERE.parent / ".venv" / "bin" / "raytrain-hybrid"), "train", *extra, *sets]
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def ray_trial(i: int, rng: random.Random, base: Path, want: dict) -> dict:
    """``train`` through the CLI (a local Ray started by the driver, keep=2, max_failures=1), killed
    across a save: the driver (then ``train --resume <run dir>``), or a Ray Train worker (Ray Train
    restarts the worker group from the newest intact checkpoint itself)."""
    trial = base / "ray" / f"t{i:03d}"
    out, log = trial / "run", trial / "cli.log"
    user = out / "NOTES.md"
    user.parent.mkdir(parents=True)
    user.write_text("the user's file\n")
    fault = {"step": rng.randint(2, ft.STEPS), "target": rng.choice(["driver", "worker"]),
             "when": rng.choice(["save_started", "complete"]), "delay": round(rng.uniform(0, 0.6), 3)}  # fmt: skip
    ckpts, t0 = out / "checkpoints", time.time()
    proc = _train(out, [], log)
    mark = ckpts / (f"step_{fault['step']}.partial" if fault["when"] == "save_started" else f"step_{fault['step']}")
    while not mark.exists() and proc.poll() is None and time.time() - t0 < 400:
        time.sleep(0.02)
    time.sleep(fault["delay"])
    complete = sorted(int(p.name[5:]) for p in ckpts.glob("step_*") if (p / "manifest.json").exists())
    row = {"trial": trial.name, "fault": fault, "complete_when_fired": complete, "fired": proc.poll() is None}
    if fault["target"] == "driver":
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        _end_session(proc, grace=1.0)
    else:
        workers = [p for p in _session_pids(proc.pid) if "RayTrainWorker" in Path(f"/proc/{p}/cmdline").read_text()]
        if workers:
            os.kill(rng.choice(sorted(workers)), signal.SIGKILL)
        row["fired"] = row["fired"] and bool(workers)
        proc.wait(timeout=600)
        _end_session(proc)
    row["first_run"] = proc.returncode
    if fault["target"] == "driver":  # keep=2: the newest complete checkpoint must be intact; older ones may be pruned
        row["checkpoints_lost"] = [n for n in complete[-1:] if not ft.intact(open_store(str(ckpts / f"step_{n}")))]
    else:  # Ray Train restarted the group in the run: from the newest complete checkpoint, or one was lost
        said = [int(m) for m in re.findall(r"continues from step (\d+)", log.read_text())]
        row["group_restarted_from"] = said
        row["checkpoints_lost"] = [n for n in complete[-1:] if said and min(said) < n]
    if fault["target"] == "driver" or proc.returncode != 0:
        second = _train(out, ["--resume", str(out)], log)
        second.wait(timeout=600)
        _end_session(second)
        row["second_run"] = second.returncode
        if second.returncode == 2 and f"has done {ft.STEPS} steps already" in log.read_text():
            row["second_run"] = "nothing_left"  # the kill came after the last step's checkpoint was complete
    losses = {}
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            step = json.loads(line)
            losses[step["step"]] = step["loss"]
    diffs = [abs(losses[s] - v) / abs(v) for s, v in want.items() if s in losses]
    row["losses_equal"] = len(diffs) == len(want) and max(diffs, default=0.0) <= ft.TOLERANCE
    row["max_rel_diff"] = max(diffs, default=None)
    row["user_files_changed"] = int(user.read_text() != "the user's file\n")
    row["checkpoints_at_end"] = sorted(p.name for p in ckpts.glob("step_*"))
    row["restarts_said"] = [ln for ln in log.read_text().splitlines() if "restart" in ln.lower()][:4]
    row["wall_s"] = round(time.time() - t0, 1)
    return row


NOT_COVERED = (
    "pruning of old checkpoints (checkpoint.keep is Ray Train's num_to_keep; runs without Ray keep all: the CLI "
    "trials with Ray, faults_ray.json, cover it); a node removed from a simulated Ray cluster; power loss (SIGKILL "
    "leaves the page cache, so the fsyncs are not tested); a second fault during the restart"
)


def ray_summary(rows: list[dict]) -> dict:
    fired = [r for r in rows if r["fired"]]
    return {
        "trials": len(rows),
        "faults_injected": len(fired),
        "ended": sum(r.get("second_run", r["first_run"]) == 0 for r in fired),
        "killed_after_the_last_checkpoint_was_complete": sum(r.get("second_run") == "nothing_left" for r in fired),
        "runs_whose_every_loss_equals_the_uninterrupted_run": sum(r["losses_equal"] for r in fired),
        "newest_complete_checkpoint_lost": sum(len(r["checkpoints_lost"]) for r in fired),
        "user_files_changed": sum(r["user_files_changed"] for r in fired),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=55, help="per storage kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="local,s3")
    p.add_argument("--ray-trials", type=int, default=0, help="trials through the CLI with Ray (~3 min each)")
    p.add_argument("--out", default=str(HERE / "results" / "faults.json"))
    args = p.parse_args()
    ctx = fi.context()
    base = Path(tempfile.mkdtemp(prefix="faults-"))
    load_before, t0 = os.getloadavg()[0], time.time()
    result = {
        "command": "cd <repo> && nice -n 10 .venv/bin/python benchmarks/bench_faults.py " + shlex.join(sys.argv[1:]),
        "seed": args.seed,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "started_utc": time.strftime("%H:%M", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, no GPU ({platform.platform()}), shared with other jobs: load below",
        "driven_by": "gloo processes without Ray (tests/fault_injection.py), for every trial: a driver process "
        "doing the CLI driver's start (launch.start.prepare_run_dir: the run directory's checks, on a resume "
        "resolve() of the newest intact checkpoint and the trajectory check; then the run's lease) and the "
        "ranks running engine.worker.run_worker from that point; a driver kill is SIGKILL of the driver and "
        "every rank at once (a dead driver's job goes with it); after a worker's kill the others are killed "
        "as a worker group is torn down",
        "config": ft.CONFIG,
        "world_size": ft.WORLD,
        "loss_tolerance_relative": ft.TOLERANCE,
        "not_covered": NOT_COVERED,
        "kinds": {},
    }
    for kind in filter(None, args.kinds.split(",")):
        result["kinds"][kind] = campaign(kind, args, ctx, base)
    if args.ray_trials:
        local = result["kinds"].get("local") or {"reference": ft.reference(ctx, "local", base / "reference", {})}
        rng, want = random.Random(f"{args.seed}-ray"), local["reference"]["losses"]
        rows = [ray_trial(i, rng, base, want) for i in range(args.ray_trials)]
        for row in rows:
            print(json.dumps(row), flush=True)
        result["ray_cli"] = {
            "driven_by": "the CLI (raytrain-hybrid train, a private local Ray, checkpoint.keep=2, run.max_failures=1, "
            "data.path=memory), killed from outside once a save of the sampled step started or completed, after "
            "a seeded delay: the driver (SIGKILL, then its session's processes: the local Ray it started; then "
            "train --resume <run dir>) or one Ray Train worker (Ray Train restarts the group itself); losses "
            "compared with the gloo campaign's uninterrupted run (same config)",
            "extra_config": ["data.path=memory", "checkpoint.keep=2", "run.max_failures=1"],
            "not_covered": "object storage (these runs write to a local disk); kills at chosen points inside the "
            "save path (the kill comes from outside, after a delay)",
            "summary": ray_summary(rows),
            "trials": rows,
        }
    if not result["kinds"]:  # the CLI trials alone
        for key in ("driven_by", "not_covered", "kinds"):
            result.pop(key)
    result["wall_s"] = round(time.time() - t0)
    result["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v["summary"] for k, v in result["kinds"].items()}, indent=1))
    if "ray_cli" in result:
        print(json.dumps(ray_summary(result["ray_cli"]["trials"]), indent=1))
    shutil.rmtree(base, ignore_errors=True) if not any(
        r.get("kept_at") for v in result["kinds"].values() for r in v["trials"]
    ) else None


if __name__ == "__main__":
    main()
