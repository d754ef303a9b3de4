"""The quick start's time to its first step: under torchrun (no Ray) and on Ray, side by side.

    .venv/bin/python benchmarks/bench_torchrun_startup.py [--rounds 2] [--steps 3]

Both run the quick start's layout as a user types it (the default config: dp=2 tp=2 pp=2, the
shipped corpus), alternating so that the shared machine's noise falls on both:

- ray: `raytrain-hybrid train` (a private local Ray, Ray Train's workers, Ray Data);
- torchrun: `torchrun --standalone --nproc-per-node 8 -m raytrain_hybrid.cli train`;
- torchrun-1-rank: the same model at dp=tp=pp=1 on one rank, the floor of one rank's start.

first_step_s is measured from outside, the same for both: from the command's start until its
"step 1/N" progress line is read on its stdout; wall_s is the whole command, exit included. The
phases are the run's own summary.json startup_s (rank 0's marks). Writes
benchmarks/results/torchrun_startup.json.
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
    t0 = time.perf_counter()
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
    return {"first_step_s": round(first, 2), "wall_s": round(wall, 2), "phases": summary["startup_s"]}


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
        "runs": runs,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_first_step_s", "median_wall_s")}))


if __name__ == "__main__":
    main()
