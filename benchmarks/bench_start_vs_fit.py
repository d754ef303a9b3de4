"""Start-up against Ray's own floor (issue 19, point 4), side by side on one machine.

    .venv/bin/python benchmarks/bench_start_vs_fit.py [--rounds 2]

Three commands, in turn per round (the order reversed every other round) so that the shared
machine's noise falls on each, each timed from its launch by this script as a user sees it:

- ``train``: the main job as the README's first command runs it (`raytrain-hybrid train`, the
  default (2,2,2) on a local Ray it starts, the shipped corpus through Ray Data), 3 steps; the
  time is when its first ``step 1/3`` line appears on stdout; its summary's start-up breakdown
  (summary.json ``startup_s``, and ``startup_cpu_s``: rank 0's worker CPU per phase) is kept.
- ``trivial_fit``: the floor: a fresh Python that starts a local Ray with the same CPUs the
  launcher asks for and runs a Ray Train ``TorchTrainer.fit()`` with the same number of workers
  on gloo whose function only reports once; the time is when rank 0 reports (written to a file,
  with its process's CPU seconds then), and when ``fit()`` returns.
- ``restart``: a node's loss on a simulated cluster (``ray.cluster_utils.Cluster`` in its own
  Python: a head of 2 CPUs for the driver and Ray Data's read tasks, two nodes of 4 fake GPUs
  and 4 CPUs), the same main job elastic at dp=2, min_dp=1 (tp=2 pp=2: a replica a node),
  through the CLI joined by ``RAY_ADDRESS``, a checkpoint every 4 steps, Ray Train's defaults
  (its 2 s health check). Once ``checkpoints/step_4`` is complete a node with workers is
  removed; the time is from that removal to the first ``step`` line after the driver's
  ``resize`` line (the group restarted at dp=1 from step 4: detection, teardown, a 4-worker
  start, the checkpoint's load, the first batch and step). Its own start (launch to the first
  step at 8 workers) is kept beside it.

Writes benchmarks/results/start_vs_fit.json (medians and every run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "start_vs_fit.json"
WORKERS = 8  # the default layout's world size


def _trivial_fit(marker: str) -> None:
    """The floor, run in its own Python (``--trivial-fit MARKER``)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    def loop(config: dict) -> None:
        import ray.train

        if ray.train.get_context().get_world_rank() == 0:  # when, and the CPU its process spent so far
            Path(config["marker"]).write_text(json.dumps({"t": time.time(), "cpu": time.process_time()}))
        ray.train.report({"ok": 1})

    # The CPUs the launcher gives its own local Ray for 8 workers (launch/runtime/session.ensure_ray).
    ray.init(address="local", num_cpus=max(WORKERS + 1, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    with tempfile.TemporaryDirectory() as storage:
        TorchTrainer(
            loop,
            train_loop_config={"marker": marker},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=WORKERS),
            run_config=RunConfig(name="trivial", storage_path=storage),
        ).fit()
    print("fit_returned", time.time(), flush=True)
    ray.shutdown()


RESTART_STEPS, RESTART_SAVE_EVERY = 12, 4


def _restart_sim(workdir: str) -> None:
    """The node loss, run in its own Python (``--restart-sim DIR``): prints one JSON line."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(wait=False, num_cpus=4, num_gpus=4) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out = Path(workdir) / "run"
    sets = [
        "cluster.use_gpu=true", "cluster.backend=gloo",  # fake GPUs: the workers run on the CPU
        "parallelism.dp=2", "parallelism.min_dp=1", "parallelism.tp=2", "parallelism.pp=2",
        f"train.steps={RESTART_STEPS}", f"checkpoint.interval={RESTART_SAVE_EVERY}", "run.max_failures=1",
        "run.shared_fs=true", f"run.output_dir={out}",  # the simulated nodes share this disk
    ]  # fmt: skip
    exe = ROOT / ".venv" / "bin" / "raytrain-hybrid"
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    t0 = time.time()
    err = Path(workdir) / "stderr.txt"  # a file: stdout is read line by line as it comes
    proc = subprocess.Popen([str(exe), "train", *[a for s in sets for a in ("--set", s)]], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=err.open("w"), text=True)  # fmt: skip
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln.rstrip()) for ln in proc.stdout))
    reader.start()
    marker = out / "checkpoints" / f"step_{RESTART_SAVE_EVERY}" / "manifest.json"
    removed = None
    while proc.poll() is None and time.time() - t0 < 900:
        if removed is None and marker.exists():
            removed = time.time()
            cluster.remove_node(nodes[-1])  # both nodes hold a replica: either is "a node with workers"
        time.sleep(0.05)
    proc.wait(timeout=60)
    reader.join(timeout=60)
    ray.shutdown()
    cluster.shutdown()
    if proc.returncode or removed is None:
        said = "\n".join(x for _, x in lines)
        raise RuntimeError(f"rc {proc.returncode}, node removed at {removed}:\n{said}\n{err.read_text()[-3000:]}")
    first = next(t for t, x in lines if x.startswith("step "))
    resized = next(i for i, (_, x) in enumerate(lines) if x.startswith("resize:"))
    after = next(t for t, x in lines[resized:] if x.startswith("step "))
    summary = json.loads((out / "summary.json").read_text())
    print("RESULT " + json.dumps({
        "start_to_first_step_s": round(first - t0, 2),
        "loss_to_first_step_s": round(after - removed, 2),
        "said": [x for _, x in lines if x.startswith(("restart", "resize"))],
        "starts": summary["elastic"]["starts"],
    }), flush=True)  # fmt: skip


def run_restart(tmp: Path) -> dict:
    work = tmp / f"restart-{time.time_ns()}"
    work.mkdir()
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--restart-sim", str(work)], capture_output=True, text=True,
                          cwd=ROOT)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    row = json.loads(next(ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")))
    return {**row, "wall_s": round(time.time() - t0, 2)}


def run_train(tmp: Path) -> dict:
    out = tmp / f"train-{time.time_ns()}"
    exe = ROOT / ".venv" / "bin" / "raytrain-hybrid"
    t0 = time.time()
    proc = subprocess.Popen(
        [str(exe), "train", "--set", "train.steps=3", "--set", f"run.output_dir={out}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    first = None
    for line in proc.stdout:
        if first is None and line.startswith("step 1/"):
            first = time.time() - t0
    _, err = proc.communicate()
    wall = time.time() - t0
    if proc.returncode or first is None:
        raise RuntimeError(err[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    return {"to_first_step_s": round(first, 2), "wall_s": round(wall, 2), "startup_s": summary["startup_s"],
            "startup_cpu_s": summary["startup_cpu_s"]}  # fmt: skip


def run_trivial(tmp: Path) -> dict:
    marker = tmp / f"reported-{time.time_ns()}"
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, __file__, "--trivial-fit", str(marker)], capture_output=True, text=True, cwd=ROOT
    )
    wall = time.time() - t0
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    returned = float(next(ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("fit_returned")))
    reported = json.loads(marker.read_text())
    return {
        "to_first_report_s": round(reported["t"] - t0, 2),
        "worker_cpu_s": round(reported["cpu"], 3),  # rank 0's process, at its report
        "to_fit_returned_s": round(returned - t0, 2),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trivial-fit", metavar="MARKER", help=argparse.SUPPRESS)
    ap.add_argument("--restart-sim", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trivial_fit:
        _trivial_fit(args.trivial_fit)
        return
    if args.restart_sim:
        _restart_sim(args.restart_sim)
        return
    runs: dict[str, list[dict]] = {"train": [], "trivial_fit": [], "restart": []}
    order = [("train", run_train), ("trivial_fit", run_trivial), ("restart", run_restart)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, fn in order if r % 2 == 0 else order[::-1]:
                row = fn(Path(tmp))
                runs[name].append(row)
                print(name, json.dumps(row), flush=True)
    train = statistics.median(r["to_first_step_s"] for r in runs["train"])
    floor = statistics.median(r["to_first_report_s"] for r in runs["trivial_fit"])
    result = {
        "command": "cd <repo> && .venv/bin/python benchmarks/bench_start_vs_fit.py --rounds " + str(args.rounds),
        "date": time.strftime("%Y-%m-%d"),
        "machine_cpus": os.cpu_count(),
        "load_average_1m_before": round(load_before, 2),
        "workers": WORKERS,
        "median_train_to_first_step_s": train,
        "median_trivial_fit_to_first_report_s": floor,
        "ratio": round(train / floor, 3),
        "goal": "train within 1.1x the trivial fit; the restart below the start (issue 19)",
        "median_restart_loss_to_first_step_s": statistics.median(r["loss_to_first_step_s"] for r in runs["restart"]),
        "median_restart_run_start_to_first_step_s": statistics.median(
            r["start_to_first_step_s"] for r in runs["restart"]
        ),
        "median_train_startup_s": {
            k: statistics.median(r["startup_s"][k] for r in runs["train"]) for k in runs["train"][0]["startup_s"]
        },
        # CPU of one worker process (rank 0) to its first step / its report: with 8 workers on
        # fewer cores the start is CPU-bound, and the difference is what each of ours adds.
        "median_train_worker_cpu_s": {
            k: statistics.median(r["startup_cpu_s"][k] for r in runs["train"])
            for k in runs["train"][0]["startup_cpu_s"]
        },
        "median_trivial_fit_worker_cpu_s": statistics.median(r["worker_cpu_s"] for r in runs["trivial_fit"]),
        "runs": runs,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith("median_") or k == "ratio"}))


if __name__ == "__main__":
    main()
