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


def _alive_in_session(sid: int) -> list[str]:
    """The processes of session ``sid`` that still run (zombies left out), as "pid name"."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,comm="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [f"{r[0]} {r[3]}" for r in rows if len(r) == 4 and int(r[1]) == sid and not r[2].startswith("Z")]


class _Watcher:
    """Every complete checkpoint seen while a trial runs: step -> (launch id, manifest digest,
    time), as first seen, polled every 20 ms from a thread."""

    def __init__(self, ckpts: Path) -> None:
        import threading

        self.ckpts, self.seen, self.stop = ckpts, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def now(self) -> dict:
        found = {}
        for p in self.ckpts.glob("step_*"):
            with contextlib.suppress(OSError, ValueError):
                text = (p / "manifest.json").read_bytes()
                found[int(p.name[5:])] = (json.loads(text).get("launch_id"), ft.hashlib.sha256(text).hexdigest())
        return found

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            for step, seen in self.now().items():
                self.seen.setdefault(step, (*seen, time.time()))  # (launch id, digest, first seen at)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def ray_driver_kill_trial(i: int, rng: random.Random, base: Path, want: dict) -> dict:
    """``train`` through the CLI (a local Ray started by the driver, keep=2), its driver alone
    killed (SIGKILL) during the save of a sampled step or during the step after it, and
    ``train --resume <run dir>`` started at once, while the killed run's workers may still live.
    A complete checkpoint of the killed run is lost when, at the end, it is gone or replaced
    although it was newer than the one the resume picked (older ones are checkpoint.keep's to
    prune); the killed run's processes still running 5 s and 20 s after the kill are listed."""
    trial = base / "ray_driver" / f"t{i:03d}"
    out, log = trial / "run", trial / "cli.log"
    user = out / "NOTES.md"
    user.parent.mkdir(parents=True)
    user.write_text("the user's file\n")
    when = rng.choice(["during_save", "step_after"])  # (a save takes ~0.1 s here; a step ~0.5 s)
    fault = {"step": rng.randint(2, ft.STEPS - 1), "when": when,
             "delay": round(rng.uniform(0, 0.08 if when == "during_save" else 0.5), 3)}  # fmt: skip
    ckpts, t0 = out / "checkpoints", time.time()
    watcher = _Watcher(ckpts)
    proc = _train(out, [], log)
    # During the save: its staging directory is there (async: the save runs on into the next step);
    # the step after: the save is complete (its manifest written), the next step under way.
    mark = ckpts / (f"step_{fault['step']}.partial" if fault["when"] == "during_save" else f"step_{fault['step']}")
    while not mark.exists() and proc.poll() is None and time.time() - t0 < 400:
        time.sleep(0.01)
    time.sleep(fault["delay"])
    row = {"trial": trial.name, "fault": fault, "fired": proc.poll() is None}
    complete = watcher.now()
    row["complete_when_fired"] = sorted(complete)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.time()
    second = _train(out, ["--resume", str(out)], log)  # at once: the killed run's workers may live on
    proc.wait()
    left: dict = {}
    for after in (5, 20):
        time.sleep(max(0.0, killed_at + after - time.time()))
        left[f"{after}s"] = _alive_in_session(proc.pid)
    row["killed_run_processes_left"] = left
    second.wait(timeout=900)
    time.sleep(3)
    row["resumed_run_processes_left_3s_after_its_end"] = _alive_in_session(second.pid)
    _end_session(second)
    _end_session(proc)
    watcher.close()
    row["first_run"], row["second_run"] = proc.returncode, second.returncode
    text = log.read_text()
    if second.returncode == 0 and "resume: nothing left to train" in text:
        row["second_run"] = "nothing_left"  # the kill came after the last step's checkpoint was complete
    picked = re.findall(r"resumed from \S+/step_(\d+) at step", text)
    if row["second_run"] == "nothing_left":  # it picked the last step's checkpoint, and completed the records
        picked = re.findall(rf"checkpoint \S+/step_(\d+) has done all {ft.STEPS} steps", text)
    row["resumed_from"] = int(picked[-1]) if picked else None
    # The killed run's checkpoints: those of its launch (seen complete before the resume could have
    # saved any: its Ray takes far longer than 10 s to start).
    killed_launch = {v[0] for v in watcher.seen.values() if v[2] < killed_at + 10}
    first_launch = {s: v[:2] for s, v in watcher.seen.items() if v[0] in killed_launch}
    final = watcher.now()
    row["complete_seen_of_the_killed_run"] = sorted(first_launch)
    row["killed_run_completed_after_the_pick"] = [
        s for s in first_launch if row["resumed_from"] is not None and s > row["resumed_from"]
    ]
    newest = max(first_launch, default=None)
    gone_or_replaced = [
        s for s, v in sorted(first_launch.items())
        if final.get(s) != v or not ft.intact(open_store(str(ckpts / f"step_{s}")))
    ]  # fmt: skip
    pruned = set(re.findall(r"removed (step_\d+)", text))
    # Lost: complete in the killed run, newer than the checkpoint the resume picked (or the newest
    # one when nothing was picked), and gone or replaced at the end.
    resumed = row["resumed_from"]
    row["checkpoints_lost"] = [
        s for s in gone_or_replaced if (resumed is not None and s > resumed) or (resumed is None and s == newest)
    ]
    row["resumed_from_the_newest_complete"] = row["resumed_from"] == newest if newest is not None else None
    row["older_gone_to_checkpoint_keep"] = [s for s in gone_or_replaced if s not in row["checkpoints_lost"]]
    row["pruning_said"] = sorted(pruned)
    losses = {}
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                step = json.loads(line)
                losses[step["step"]] = step["loss"]
    diffs = [abs(losses[s] - v) / abs(v) for s, v in want.items() if s in losses]
    row["losses_equal"] = len(diffs) == len(want) and max(diffs, default=0.0) <= ft.TOLERANCE
    row["max_rel_diff"] = max(diffs, default=None)
    # A step the killed run's workers made after its driver died: that driver never heard of it,
    # and the resume takes its metrics from the checkpoints' records; missing here, no record kept it.
    row["steps_missing_from_metrics"] = sorted(set(want) - set(losses))
    row["losses_equal_where_recorded"] = max(diffs, default=0.0) <= ft.TOLERANCE
    row["user_files_changed"] = int(user.read_text() != "the user's file\n")
    row["checkpoints_at_end"] = sorted(p.name for p in ckpts.glob("step_*"))
    row["said"] = [ln for ln in text.splitlines() if ln.startswith(("resume:", "error:"))][:6]
    row["wall_s"] = round(time.time() - t0, 1)
    return row


def driver_kill_summary(rows: list[dict]) -> dict:
    fired = [r for r in rows if r["fired"]]
    return {
        "trials": len(rows),
        "drivers_killed": len(fired),
        "by_when": _count(r["fault"]["when"] for r in fired),
        "resumed_at_once_and_ended": sum(r["second_run"] in (0, "nothing_left") for r in fired),
        "resumed_from_the_newest_complete": sum(r["resumed_from_the_newest_complete"] is True for r in fired),
        "complete_checkpoints_of_killed_runs": sum(len(r["complete_seen_of_the_killed_run"]) for r in fired),
        "killed_run_completed_a_save_after_the_resume_picked": sum(
            len(r["killed_run_completed_after_the_pick"]) for r in fired
        ),
        "complete_checkpoints_lost": sum(len(r["checkpoints_lost"]) for r in fired),
        "runs_whose_every_loss_equals_the_uninterrupted_run": sum(r["losses_equal"] for r in fired),
        "runs_whose_recorded_losses_equal_the_uninterrupted_run": sum(
            r.get("losses_equal_where_recorded", False) for r in fired
        ),
        "steps_missing_from_metrics_jsonl": sum(len(r.get("steps_missing_from_metrics", [])) for r in fired),
        "killed_runs_with_processes_left_5s_after_the_kill": sum(
            bool(r["killed_run_processes_left"]["5s"]) for r in fired
        ),
        "killed_runs_with_processes_left_20s_after_the_kill": sum(
            bool(r["killed_run_processes_left"]["20s"]) for r in fired
        ),
        "resumed_runs_with_processes_left_after_their_end": sum(
            bool(r["resumed_run_processes_left_3s_after_its_end"]) for r in fired
        ),
        "user_files_changed": sum(r["user_files_changed"] for r in fired),
    }


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
    p.add_argument(
        "--ray-driver-kills",
        type=int,
        default=0,
        help="trials through the CLI with Ray: the driver killed during a save or the step after, resumed at once",
    )
    p.add_argument(
        "--ft-trials",
        type=int,
        default=0,
        help="the fault-tolerant mode instead: seeded kills of a replica group's rank under fault_tolerance.enabled "
        "(benchmarks/bench_fault_tolerance.py, which writes results/fault_tolerance.json)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "faults.json"))
    args = p.parse_args()
    if args.ft_trials:  # one campaign script a mode; this one hands over
        script = str(HERE / "bench_fault_tolerance.py")
        os.execv(sys.executable, [sys.executable, script, "--trials", str(args.ft_trials), "--seed", str(args.seed)])
    earlier = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
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
        "doing the CLI driver's start (launch.runtime.start.prepare_run_dir: the run directory's checks, on a resume "
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
    for section, redo in (("ray_cli", args.ray_trials), ("ray_driver_kills", args.ray_driver_kills)):
        if section in earlier and not redo:  # a section this run does not redo stays, with its command
            made = {"command": earlier.get("command"), "date": earlier.get("date")}
            made = earlier[section].get("from_an_earlier_run", made)
            result[section] = {**earlier[section], "from_an_earlier_run": made}
    for kind in filter(None, args.kinds.split(",")):
        result["kinds"][kind] = campaign(kind, args, ctx, base)
    if args.ray_trials or args.ray_driver_kills:
        local = result["kinds"].get("local") or {"reference": ft.reference(ctx, "local", base / "reference", {})}
        want = local["reference"]["losses"]
    if args.ray_driver_kills:
        rng = random.Random(f"{args.seed}-ray-driver")
        rows = []
        for i in range(args.ray_driver_kills):
            rows.append(ray_driver_kill_trial(i, rng, base, want))
            print(json.dumps(rows[-1]), flush=True)
            unfinished = f"{len(rows)} of {args.ray_driver_kills}"
            section = {"unfinished": unfinished, "summary": driver_kill_summary(rows), "trials": rows}
            partial = {**result, "ray_driver_kills": section}
            Path(args.out).write_text(json.dumps(partial, indent=1) + "\n")  # a campaign cut short keeps its trials
        result["ray_driver_kills"] = {
            "driven_by": "the CLI (raytrain-hybrid train, a private local Ray, checkpoint.keep=2, run.max_failures=1, "
            "data.path=memory, a checkpoint every step, saved in the background), its driver alone killed with "
            "SIGKILL once the save of the sampled step had started (during_save: its staging directory there) or "
            "was complete (step_after: the next step under way), after a seeded delay; `train --resume <run dir>` "
            "started at once, while the killed run's workers may still run; every complete checkpoint watched "
            "(20 ms polls of the manifests) from the start to the end of the resumed run",
            "lost_means": "a checkpoint complete in the killed run, newer than the one the resume picked, gone or "
            "replaced (or not intact) at the end; older ones are checkpoint.keep's to prune",
            "extra_config": ["data.path=memory", "checkpoint.keep=2", "run.max_failures=1"],
            "summary": driver_kill_summary(rows),
            "trials": rows,
        }
    if args.ray_trials:
        rng = random.Random(f"{args.seed}-ray")
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
    print(json.dumps({k: v["summary"] for k, v in result.get("kinds", {}).items()}, indent=1))
    if "ray_cli" in result:
        print(json.dumps(ray_summary(result["ray_cli"]["trials"]), indent=1))
    if "ray_driver_kills" in result:
        print(json.dumps(result["ray_driver_kills"]["summary"], indent=1))
    shutil.rmtree(base, ignore_errors=True) if not any(
        r.get("kept_at") for v in result.get("kinds", {}).values() for r in v["trials"]
    ) else None
    if failed := failures(result):  # a campaign that found something fails, as bench_fuzz past its bound
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        sys.exit(1)


def failures(result: dict) -> list[str]:
    """What the campaign's summaries say went wrong: a complete checkpoint lost, a save the killed run
    completed after the resume picked its checkpoint, a resumed run's losses off the uninterrupted
    run's, a step missing from metrics.jsonl."""
    out = []
    for kind, section in result.get("kinds", {}).items():
        if lost := section["summary"].get("checkpoints_lost"):
            out.append(f"{kind}: {lost} complete checkpoints lost")
    if "ray_cli" in result and (lost := result["ray_cli"]["summary"]["newest_complete_checkpoint_lost"]):
        out.append(f"ray_cli: {lost} complete checkpoints lost")
    if "ray_driver_kills" in result and "from_an_earlier_run" not in result["ray_driver_kills"]:
        summary = result["ray_driver_kills"]["summary"]
        for key in ("complete_checkpoints_lost", "killed_run_completed_a_save_after_the_resume_picked",
                    "steps_missing_from_metrics_jsonl"):  # fmt: skip
            if summary[key]:
                out.append(f"ray_driver_kills: {key} = {summary[key]}")
        if summary["runs_whose_every_loss_equals_the_uninterrupted_run"] < summary["drivers_killed"]:
            out.append("ray_driver_kills: a resumed run's losses differ from the uninterrupted run's")
    return out


if __name__ == "__main__":
    main()
