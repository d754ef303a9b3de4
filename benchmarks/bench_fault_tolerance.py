"""Per-step fault tolerance ([fault_tolerance]) under seeded kills, against the restart path.

    nice -n 10 .venv/bin/python benchmarks/bench_fault_tolerance.py [--trials 30] [--seed 0]

Two replica groups of a tiny Llama (dp=2 x tp=2: each group two gloo ranks, a world of its own,
as two torchrun launches are; tests/ft_trial.py) meet at a torchft Lighthouse in this process
(heartbeat timeout 2 s). Each trial kills, by SIGKILL, one seeded rank of a seeded group at a
seeded instant of a seeded step (checkpoints are saved every 2 steps in the background, so some
kills land in a save); the group's other rank is killed as torchrun's agent kills it, and the
group is started again at once, as ``torchrun --max-restarts`` does. The surviving group waits at
the second-to-last step until the restarted group's Manager is up, so every trial sees a rejoin.

Per trial: from the kill to the survivor's next committed step, and to the first committed step
with the restarted group back in the quorum; steps lost or applied twice (the survivor's steps
must be 0..N-1, each once); and the oracle: the survivor's losses, per-parameter gradient norms
and final weights equal a single-process transformers loop replaying the participation record
(fp32, 1e-4), and the restarted group ends with the survivor's weights.

The restart path on the same run and machine: one world of the same 4 ranks without fault
tolerance, a rank killed in the same way, every rank started again from the newest complete
checkpoint (what a restart does, without Ray's own restart time, which only adds to it): from the
kill to its first step again, and the steps redone. Writes benchmarks/results/fault_tolerance.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from ft_trial import Group, reached, wait_until  # noqa: E402
from gloo_harness import context  # noqa: E402
from reference import memory_windows, reference_run  # noqa: E402
from test_oracle import MEMORY, SHORT, layout, oracle_mismatches  # noqa: E402

from raytrain_hybrid.checkpoint.manifest import MANIFEST  # noqa: E402
from raytrain_hybrid.config import load_config  # noqa: E402

STEPS = 10
# train.lr=3e-5: at the default rate AdamW amplifies fp32 rounding past the oracle's 1e-4 after about
# six steps in any layout (a plain dp=2 tp=2 run without fault tolerance too); at 3e-5 ten steps hold.
BASE = (*SHORT, *MEMORY, f"train.steps={STEPS}", "train.lr=3e-5", *layout(2, 2, 1, "1F1B", 2), "checkpoint.interval=2")


def _after(history: list[dict], t: float, victim: int | None = None) -> float | None:
    ends = [h["t_end"] for h in history if h["t_end"] > t and (victim is None or victim in h["replicas_in_step"])]
    return min(ends) - t if ends else None


def _judge(row: dict, survivor: dict, cfg, killed: float, groups: int) -> dict[int, list[int]]:
    """The survivor's participation record, steps lost or applied twice, its next step after the
    kill, and the oracle: a single-process run replaying the record (the rows of the groups in each
    step) against the survivor's losses, gradient norms and final weights. Returns the record."""
    history = survivor["history"]
    record = {h["step"]: h["replicas_in_step"] for h in history}
    steps = [h["step"] for h in history]
    row.update(
        survivor_next_commit_s=_after(history, killed),
        steps_lost=sorted(set(range(STEPS)) - set(steps)),
        steps_twice=sorted({s for s in steps if steps.count(s) > 1}),
    )
    share = cfg.train.global_batch_size // groups
    batches = memory_windows(cfg, STEPS)
    replay = [torch.cat([batches[s][g * share : (g + 1) * share] for g in record[s]]) for s in sorted(record)]
    reference = reference_run(cfg, windows=replay, initial=survivor["probe"]["initial"])
    row["oracle_mismatches"] = oracle_mismatches(survivor, reference)[:5]
    return record


def ft_trial(i: int, rng: random.Random, base: Path, ctx) -> dict:
    from torchft.coordination import LighthouseServer

    victim, rank = rng.randrange(2), rng.randrange(2)
    step, delay = rng.randrange(1, STEPS - 3), rng.uniform(0.0, 0.3)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    marker, out = str(base / f"ft{i}" / "mark"), base / f"ft{i}"
    out.mkdir(parents=True)
    common = (
        *BASE,
        "fault_tolerance.enabled=true",
        f"fault_tolerance.lighthouse={lighthouse.address()}",
        "fault_tolerance.step_timeout_s=20",
    )
    cfgs = [
        load_config(None, [*common, f"fault_tolerance.replica_group={g}", f"run.output_dir={out / f'replica_{g}'}"])
        for g in (0, 1)
    ]
    names = ["group0", "group1"]
    groups = [Group(ctx, cfgs[g], marker, names[g], {"waits_at": STEPS - 2} if g != victim else {}) for g in (0, 1)]
    row = {"trial": i, "victim_group": victim, "victim_rank": rank, "kill_step": step, "kill_delay_s": round(delay, 3)}
    try:
        assert wait_until(lambda: reached(marker, names[victim], step)), "the victim never reached its step"
        time.sleep(delay)
        os.kill(groups[victim].procs[rank].pid, signal.SIGKILL)
        killed = time.time()
        groups[victim].kill()
        row["victim_had_finished"] = False
        back = Group(ctx, cfgs[victim], marker, "rejoined", {"rejoins": True})
        survivor = groups[1 - victim].result()
        rejoined = back.result()
    finally:
        lighthouse.shutdown()
    history = survivor["history"]
    record = _judge(row, survivor, cfgs[0], killed, groups=2)
    row.update(
        rejoined_in_quorum_s=_after(history, killed, victim),
        steps_without_victim=sorted(s for s, g in record.items() if victim not in g),
        rejoined_at=rejoined["history"][0]["step"] if rejoined["history"] else None,
        median_step_s=statistics.median(h["step_time_s"] for h in history),
    )
    final, healed = survivor["probe"]["final"], rejoined["probe"]["final"]
    row["rejoined_weights_max_abs_diff"] = max(float(np.abs(final[n] - healed[n]).max()) for n in final)
    return row


def double_trial(i: int, rng: random.Random, base: Path, ctx) -> dict:
    """Three replica groups of one rank each (dp=3); two of them killed at once in a seeded step,
    both started again 3-5 s later. The third goes on alone meanwhile; the record and the oracle as
    above."""
    from torchft.coordination import LighthouseServer

    step, delay, restart = rng.randrange(1, STEPS - 3), rng.uniform(0.0, 0.3), rng.uniform(3.0, 5.0)
    survivor = rng.randrange(3)
    victims = [g for g in range(3) if g != survivor]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    marker, out = str(base / f"double{i}" / "mark"), base / f"double{i}"
    out.mkdir(parents=True)
    common = (*SHORT, *MEMORY, f"train.steps={STEPS}", "train.lr=3e-5", *layout(3, 1, 1, "1F1B", 2))
    common += ("train.global_batch_size=18", "fault_tolerance.enabled=true", "fault_tolerance.step_timeout_s=20")
    common += (f"fault_tolerance.lighthouse={lighthouse.address()}",)
    cfgs = [load_config(None, [*common, f"fault_tolerance.replica_group={g}"]) for g in range(3)]
    names = [f"group{g}" for g in range(3)]
    role = {survivor: {"waits_at": STEPS - 2}}
    groups = [Group(ctx, cfgs[g], marker, names[g], role.get(g, {})) for g in range(3)]
    row = {"trial": i, "survivor": survivor, "kill_step": step, "kill_delay_s": round(delay, 3)}
    row["restart_after_s"] = round(restart, 2)
    try:
        assert wait_until(lambda: all(reached(marker, names[g], step) for g in victims))
        time.sleep(delay)
        for g in victims:
            os.kill(groups[g].procs[0].pid, signal.SIGKILL)
        killed = time.time()
        # Both back after a restart's time (longer than the Lighthouse's 2 s heartbeat timeout, as any
        # real restart is): the survivor trains on alone meanwhile.
        time.sleep(restart)
        back = [Group(ctx, cfgs[g], marker, f"back{g}", {"rejoins": True}) for g in victims]
        result = groups[survivor].result()
        for b in back:
            b.result()
    finally:
        lighthouse.shutdown()
    record = _judge(row, result, cfgs[0], killed, groups=3)
    row["steps_alone"] = sorted(s for s, g in record.items() if g == [survivor])
    row["steps_with_all"] = sorted(s for s, g in record.items() if g == [0, 1, 2])
    return row


def _newest(run: Path) -> str | None:
    done = [d for d in (run / "checkpoints").glob("step_*") if (d / MANIFEST).exists()]
    return str(max(done, key=lambda d: int(d.name.split("_")[1]))) if done else None


def restart_trial(i: int, rng: random.Random, base: Path, ctx) -> dict:
    """The same kill without fault tolerance: every rank again from the newest checkpoint."""
    rank, step, delay = rng.randrange(4), rng.randrange(3, STEPS - 2), rng.uniform(0.0, 0.3)
    marker, out = str(base / f"restart{i}" / "mark"), base / f"restart{i}"
    out.mkdir(parents=True)
    cfg = load_config(None, [*BASE, f"run.output_dir={out / 'run'}", "checkpoint.async_save=false"])
    first = Group(ctx, cfg, marker, "first")
    assert wait_until(lambda: reached(marker, "first", step))
    time.sleep(delay)
    os.kill(first.procs[rank].pid, signal.SIGKILL)
    killed = time.time()
    first.kill()
    resume = _newest(out / "run")
    again = Group(ctx, cfg, marker, "again", resume=resume).result()
    start = again["history"][0]["step"]
    return {
        "trial": i,
        "kill_rank": rank,
        "kill_step": step,
        "resumed_at": start,
        "steps_redone": step - start,
        "first_step_again_s": again["history"][0]["t_end"] - killed,
        "median_step_s": statistics.median(h["step_time_s"] for h in again["history"]),
    }


_WORKERS_OF = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
jobs = [j["JobID"] for j in ray._private.state.jobs() if int(j.get("DriverPid") or 0) == int(sys.argv[2])]
live = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
live = [a for a in live if a["ActorClassName"] == "RayTrainWorker"]
print(json.dumps([a["Pid"] for a in live if a["JobID"] in jobs]))
"""


def ray_trial(i: int, base: Path) -> dict:
    """On a real `ray start` head (token authentication, as Ray turns it on): a Lighthouse
    (`raytrain-hybrid lighthouse`), two `train` launches of dp=2 x tp=1 (one worker a group,
    fault_tolerance.min_replicas=2, run.max_failures=1); once group 1 has trained two steps one of
    its Ray Train workers is SIGKILLed. Ray Train restarts group 1's worker group alone; group 0
    waits in its quorum and goes on. From the kill to group 0's next step, both launches' exits and
    restarts, and group 0's losses against the single-process reference (1e-4; lr 3e-5 for its 12 steps)."""
    import secrets
    import socket
    import subprocess

    import ray  # (its address helper only: this process joins no cluster)

    bin_dir = Path(sys.executable).parent
    tmp = base / f"ray{i}"
    tmp.mkdir(parents=True)
    (tmp / "token").write_text(secrets.token_hex(32))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp / "token")}
    env.pop("RAY_ADDRESS", None)

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    gcs = port()
    head = [str(bin_dir / "ray"), "start", "--head", f"--port={gcs}", "--num-cpus=6", "--include-dashboard=false"]
    head += [f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats", f"--ray-client-server-port={port()}"]
    head += [f"--dashboard-agent-listen-port={port()}", f"--dashboard-agent-grpc-port={port()}"]
    head += [f"--runtime-env-agent-port={port()}", f"--metrics-export-port={port()}"]
    # --block in a session of its own: stopped by killing that session, never `ray stop` (which
    # would stop every Ray on the machine, the test suite's and other runs' too).
    head_proc = subprocess.Popen(
        [*head, "--block"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    address = f"{ray.util.get_node_ip_address()}:{gcs}"
    wait_until(lambda: (tmp / "ray" / "session_latest").exists(), limit=120, every=0.5)
    light = [str(bin_dir / "raytrain-hybrid"), "lighthouse", "--port", "0", "--join-timeout-s", "1"]
    lighthouse = subprocess.Popen(
        [*light, "--heartbeat-timeout-s", "2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    common = (*SHORT, *MEMORY, "train.steps=12", "train.lr=3e-5", *layout(2, 1, 1, "1F1B", 2))
    sets = [*common, "fault_tolerance.enabled=true", "fault_tolerance.min_replicas=2", "run.max_failures=1"]
    sets += ["fault_tolerance.step_timeout_s=20", "checkpoint.interval=2", f"run.output_dir={tmp / 'run'}"]
    row: dict = {"trial": i}
    try:
        sets.append(f"fault_tolerance.lighthouse={lighthouse.stdout.readline().split()[1]}")

        def launch(g: int) -> subprocess.Popen:
            args = [a for o in (*sets, f"fault_tolerance.replica_group={g}") for a in ("--set", o)]
            cmd = [str(bin_dir / "raytrain-hybrid"), "train", "--address", address, *args]
            return subprocess.Popen(cmd, stdout=(tmp / f"g{g}.log").open("w"), stderr=subprocess.STDOUT, env=env)

        groups = [launch(0), launch(1)]
        metrics = [tmp / "run" / f"replica_{g}" / "metrics.jsonl" for g in (0, 1)]

        def lines(g: int) -> int:
            return len(metrics[g].read_text().splitlines()) if metrics[g].exists() else 0

        assert wait_until(lambda: lines(1) >= 2 or any(g.poll() is not None for g in groups), limit=400)
        # Group 1's Ray Train workers, from the cluster's own tables (a process with the token).
        probe = subprocess.run(
            [sys.executable, "-c", _WORKERS_OF, address, str(groups[1].pid)], env=env, capture_output=True, text=True
        )
        pids = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else []
        assert pids, f"no Ray Train worker of group 1 found: {probe.stderr[-2000:]}"
        seen = lines(0)
        os.kill(pids[0], signal.SIGKILL)
        killed = time.time()
        wait_until(lambda: lines(0) > seen or groups[0].poll() is not None, limit=400, every=0.1)
        row["group0_next_step_s"] = round(time.time() - killed, 2) if lines(0) > seen else None
        row["killed_after_group1_steps"] = lines(1)
        row["exits"] = [g.wait(timeout=600) for g in groups]
    finally:
        lighthouse.terminate()
        lighthouse.wait(30)
        for g in groups if "groups" in locals() else []:
            g.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head_proc.pid, signal.SIGKILL)
        head_proc.wait(30)
    summaries = [json.loads((tmp / "run" / f"replica_{g}" / "summary.json").read_text()) for g in (0, 1)]
    row["restarts"] = [s["restarts"] for s in summaries]
    rows = [json.loads(line) for line in metrics[0].read_text().splitlines()]
    row["group0_steps"] = [r["step"] for r in rows]
    row["group0_replicas_in_step"] = [r["replicas_in_step"] for r in rows]
    cfg = load_config(None, list(common))
    from gloo_harness import initial_state

    want = reference_run(cfg, initial=initial_state(cfg))
    row["losses_equal_the_reference"] = len(rows) == len(want) and all(
        abs(r["loss"] - w["loss"]) <= 1e-4 * abs(w["loss"])
        and abs(r["grad_norm"] - w["grad_norm"]) <= 1e-4 * w["grad_norm"]
        for r, w in zip(rows, want, strict=False)
    )
    return row


def _run(n: int, trial, *args) -> list[dict]:
    """``n`` trials in order, each printed as it ends; a trial that fails is a finding, recorded."""
    rows = []
    for i in range(n):
        try:
            rows.append(trial(i, *args))
        except Exception as exc:  # noqa: BLE001
            rows.append({"trial": i, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--restart-trials", type=int, default=5)
    p.add_argument("--ray-trials", type=int, default=0, help="launches on a real ray start head (~3 min each)")
    p.add_argument("--double-trials", type=int, default=0, help="three groups, two killed at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "fault_tolerance.json"))
    args = p.parse_args()
    rng = random.Random(args.seed)
    ctx = context()
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        rows = _run(args.trials, ft_trial, rng, Path(tmp), ctx)
        restarts = _run(args.restart_trials, restart_trial, rng, Path(tmp), ctx)
        doubles = _run(args.double_trials, double_trial, rng, Path(tmp), ctx)
        on_ray = _run(args.ray_trials, ray_trial, Path(tmp))
    ok = [r for r in rows if "error" not in r]

    def med(key, of=ok):
        vals = [r[key] for r in of if r.get(key) is not None]
        return round(statistics.median(vals), 2) if vals else None

    summary = {
        "trials": len(rows),
        "trials_failed": len(rows) - len(ok),
        "steps_lost": sum(len(r["steps_lost"]) for r in ok),
        "steps_applied_twice": sum(len(r["steps_twice"]) for r in ok),
        "trials_matching_the_replay_reference": sum(not r["oracle_mismatches"] for r in ok),
        "rejoined_weights_equal": sum(r["rejoined_weights_max_abs_diff"] == 0.0 for r in ok),
        "median_step_s": med("median_step_s"),
        "survivor_next_commit_s": {
            "median": med("survivor_next_commit_s"),
            "max": max(
                (r["survivor_next_commit_s"] for r in ok if r["survivor_next_commit_s"] is not None), default=None
            ),
        },
        "rejoined_in_quorum_s": {
            "median": med("rejoined_in_quorum_s"),
            "max": max((r["rejoined_in_quorum_s"] for r in ok if r["rejoined_in_quorum_s"] is not None), default=None),
        },
        "two_groups_at_once": {
            "trials": len(doubles),
            "trials_failed": sum("error" in r for r in doubles),
            "steps_lost": sum(len(r.get("steps_lost", [])) for r in doubles),
            "steps_applied_twice": sum(len(r.get("steps_twice", [])) for r in doubles),
            "trials_matching_the_replay_reference": sum(not r.get("oracle_mismatches", [1]) for r in doubles),
            "survivor_next_commit_s": {
                "median": med("survivor_next_commit_s", [r for r in doubles if "error" not in r])
            },
        },
        "on_ray": {
            "trials": len(on_ray),
            "group0_next_step_s": {"median": med("group0_next_step_s", on_ray)},
            "trials_failed": sum("error" in r for r in on_ray),
            "restarts_per_group": [r.get("restarts") for r in on_ray],
            "exits": [r.get("exits") for r in on_ray],
            "losses_equal_the_reference": sum(bool(r.get("losses_equal_the_reference")) for r in on_ray),
        },
        "restart_path": {
            "trials": len(restarts),
            "first_step_again_s": {"median": med("first_step_again_s", restarts)},
            "steps_redone": {"median": med("steps_redone", restarts)},
        },
    }
    record = {
        "command": f"nice -n {os.nice(0)} .venv/bin/python benchmarks/bench_fault_tolerance.py "
        + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), CPU only, gloo",
        "torch": torch.__version__,
        "setup": "2 replica groups x (dp=1 x tp=2), tiny Llama (4 layers, seq 32, batch 16), lighthouse heartbeat "
        "timeout 2 s, join timeout 1 s, checkpoint every 2 steps",
        "summary": summary,
        "trials": rows,
        "restart_trials": restarts,
        "double_trials": doubles,
        "ray_trials": on_ray,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
