"""Start-up against Ray's own floor (issue 19, point 4), side by side on one machine.

    .venv/bin/python benchmarks/bench_start_vs_fit.py [--rounds 2]

Two commands, alternating per round so that the shared machine's noise falls on both, each
timed from its launch by this script as a user sees it:

- ``train``: the main job as the README's first command runs it (`raytrain-hybrid train`, the
  default (2,2,2) on a local Ray it starts, the shipped corpus through Ray Data), 3 steps; the
  time is when its first ``step 1/3`` line appears on stdout; its summary's start-up breakdown
  (summary.json ``startup_s``) is kept beside it.
- ``trivial_fit``: the floor: a fresh Python that starts a local Ray with the same CPUs the
  launcher asks for and runs a Ray Train ``TorchTrainer.fit()`` with the same number of workers
  on gloo whose function only reports once; the time is when rank 0 reports (written to a file),
  and when ``fit()`` returns.

Writes benchmarks/results/start_vs_fit.json (medians and every run). The time from a node's
loss to the first step after the restart is not measured here yet (it needs a multi-node
cluster; the elastic test on the simulated cluster prints about 11 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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

        if ray.train.get_context().get_world_rank() == 0:
            Path(config["marker"]).write_text(str(time.time()))
        ray.train.report({"ok": 1})

    # The CPUs the launcher gives its own local Ray for 8 workers (launch/session.ensure_ray).
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
    phases = json.loads((out / "summary.json").read_text())["startup_s"]
    return {"to_first_step_s": round(first, 2), "wall_s": round(wall, 2), "startup_s": phases}


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
    return {
        "to_first_report_s": round(float(marker.read_text()) - t0, 2),
        "to_fit_returned_s": round(returned - t0, 2),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trivial-fit", metavar="MARKER", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trivial_fit:
        _trivial_fit(args.trivial_fit)
        return
    runs: dict[str, list[dict]] = {"train": [], "trivial_fit": []}
    order = [("train", run_train), ("trivial_fit", run_trivial)]
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
        "goal": "train within 1.1x the trivial fit (issue 19)",
        "median_train_startup_s": {
            k: statistics.median(r["startup_s"][k] for r in runs["train"]) for k in runs["train"][0]["startup_s"]
        },
        "runs": runs,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_train_to_first_step_s", "median_trivial_fit_to_first_report_s",
                                             "ratio")}))  # fmt: skip


if __name__ == "__main__":
    main()
