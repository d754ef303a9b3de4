"""The quick start's time to its first step: under torchrun (no Ray) and on Ray, side by side.

    .venv/bin/python benchmarks/bench_torchrun_startup.py [--rounds 2] [--steps 3]

Both run the quick start's layout as a user types it (the default config: dp=2 tp=2 pp=2, the
shipped corpus), alternating so that the shared machine's noise falls on both:

- ray: `raytrain-hybrid train` (a private local Ray, Ray Train's workers, Ray Data);
- torchrun: `torchrun --standalone --nproc-per-node 8 -m raytrain_hybrid.cli train`;
- torchrun-1-rank: the same model at dp=tp=pp=1 on one rank, the floor of one rank's start.

first_step_s is measured from outside, the same for both: from the command's start until its
"step 1/N" progress line is read on its stdout; wall_s is the whole command, exit included. The
phases are the run's own summary.json startup_s (rank 0's marks), rank0_cpu_s its startup_cpu_s
(rank 0's process: CPU seconds per phase, whatever the machine's load). cpu_s (torchrun only) is the CPU
of the whole process tree, reaped by torchrun: on a machine with fewer cores than ranks the start
is CPU-bound, and cpu_s / cores is a floor under wall_s. (Ray's daemons are not this command's
children, so a Ray run's CPU is not counted so.)

worker_imports: where a worker's imports go, one Python alone importing what a rank imports
before its first step (torch's distributed modules, the engine, the model's transformers classes):
its CPU seconds, and -X importtime's own time per top-level package (wall clock of that process),
the largest first. Writes benchmarks/results/torchrun_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "torchrun_startup.json"
BIN = ROOT / ".venv" / "bin"
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node"]
ONE_RANK = ["--set", "parallelism.dp=1", "--set", "parallelism.tp=1", "--set", "parallelism.pp=1"]
COMMANDS = {
    "ray": [str(BIN / "raytrain-hybrid"), "train"],
    "torchrun": [*TORCHRUN, "8", "-m", "raytrain_hybrid.cli", "train"],
    # The floor of one rank's start: the same model at (1,1,1), one process, no core shared between ranks.
    "torchrun-1-rank": [*TORCHRUN, "1", "-m", "raytrain_hybrid.cli", "train", *ONE_RANK],
}


def run_once(variant: str, tmp: Path, steps: int) -> dict:
    out = tmp / f"{variant}-{time.time_ns()}"
    cmd = [*COMMANDS[variant], "--set", f"train.steps={steps}", "--set", f"run.output_dir={out}"]
    t0, cpu0 = time.perf_counter(), cpu_reaped()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    first, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if first is None and line.startswith("step 1/"):
            first = time.perf_counter() - t0
    code = proc.wait()
    wall = time.perf_counter() - t0
    if code or first is None:
        raise RuntimeError(f"{variant} exited {code}: {''.join(lines)[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    got = {"first_step_s": round(first, 2), "wall_s": round(wall, 2), "phases": summary["startup_s"]}
    got["rank0_cpu_s"] = summary.get("startup_cpu_s", {})  # rank 0's CPU seconds per phase
    if variant != "ray":
        got["cpu_s"] = round(cpu_reaped() - cpu0, 1)
    return got


def cpu_reaped() -> float:
    """CPU seconds of this process's waited-for children and their own waited-for children."""
    t = os.times()
    return t.children_user + t.children_system


# What a rank imports before its first step, in the order the worker imports it.
WORKER_IMPORTS = (
    "import time, torch, torch.distributed\n"
    "import raytrain_hybrid.engine.worker\n"
    "from raytrain_hybrid.models import get_arch\n"
    "get_arch('llama').import_model_code()\n"
    "print(time.process_time())"
)


def import_profile() -> dict:
    """One Python importing what a rank imports: its CPU seconds, and importtime's self time per
    top-level package (the 12 largest, and ours)."""
    proc = subprocess.run(
        [str(BIN / "python"), "-X", "importtime", "-c", WORKER_IMPORTS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    by_package: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, _, name = line[len("import time:") :].split("|")
        top = name.strip().split(".")[0]
        by_package[top] = by_package.get(top, 0.0) + int(own) / 1e6
    largest = sorted(by_package.items(), key=lambda kv: -kv[1])
    shown = dict(largest[:12]) | {"raytrain_hybrid": by_package.get("raytrain_hybrid", 0.0)}
    return {
        "cpu_s": round(float(proc.stdout.split()[-1]), 2),
        "importtime_self_s": {k: round(v, 3) for k, v in shown.items()},
        "importtime_total_s": round(sum(by_package.values()), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {v: [] for v in COMMANDS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for variant in list(COMMANDS) if r % 2 == 0 else reversed(COMMANDS):
                got = run_once(variant, Path(tmp), args.steps)
                print(variant, got, flush=True)
                runs[variant].append(got)
    imports = [import_profile() for _ in range(args.rounds)]
    result = {
        "command": "cd <repo> && .venv/bin/python benchmarks/bench_torchrun_startup.py --rounds "
        + str(args.rounds)
        + ("" if args.steps == 3 else f" --steps {args.steps}"),
        "what": "the quick start (default config: dp=2 tp=2 pp=2, shipped corpus) to its first step, "
        "under torchrun (no Ray) and on a private local Ray; first_step_s from the command's start to its "
        "'step 1/N' line",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU; load average at the end "
        f"{os.getloadavg()[0]:.1f} (a machine shared with other work)",
        "median_first_step_s": {v: statistics.median(x["first_step_s"] for x in rs) for v, rs in runs.items()},
        "median_wall_s": {v: statistics.median(x["wall_s"] for x in rs) for v, rs in runs.items()},
        "median_cpu_s": {v: statistics.median(x["cpu_s"] for x in rs) for v, rs in runs.items() if v != "ray"},
        "median_rank0_cpu_to_first_step_s": {
            v: statistics.median(x["rank0_cpu_s"].get("total_to_first_step", 0.0) for x in rs) for v, rs in runs.items()
        },
        "worker_imports": min(imports, key=lambda x: x["cpu_s"]),  # the least disturbed of the rounds
        "runs": runs,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    shown = ("median_first_step_s", "median_wall_s", "median_cpu_s", "worker_imports")
    print(json.dumps({k: result[k] for k in shown}))


if __name__ == "__main__":
    main()
