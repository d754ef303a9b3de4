"""Start-up benchmark: where the time from the command to the first step goes.

    .venv/bin/python benchmarks/bench_startup.py [--rounds 2]

Runs the main job as a user does (`raytrain-hybrid train`, default (2,2,2) on local Ray, the
shipped corpus through Ray Data), 3 steps, once per variant and round, alternating variants so
that the shared machine's noise falls on both. Each run's summary.json carries the phase
breakdown (launcher.startup_breakdown: Ray start, worker start, imports, process group, mesh,
model build, first batch, first step); wall is the whole command, exit included.

Variants: Ray Data's default of 32 Parquet footer-reader actors per dataset execution (each
a Python process, started by each replica leader) against the launcher's choice (one per 64
files). An earlier variant, the raylet without idle-worker prestart, was slower (see "earlier").
Writes benchmarks/results/startup.json.
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
OUT = ROOT / "benchmarks" / "results" / "startup.json"
# name -> environment of the command
VARIANTS = {
    "footer-actors-ray-default": {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "32"},
    "footer-actors-scaled": {},  # the launcher's choice: 1 per 64 files
}


def run_once(variant: str, tmp: Path) -> dict:
    out = tmp / f"{variant}-{time.time_ns()}"
    env = {**os.environ}
    env.pop("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", None)
    env.update(VARIANTS[variant])
    exe = ROOT / ".venv" / "bin" / "raytrain-hybrid"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(exe), "train", "--set", "train.steps=3", "--set", f"run.output_dir={out}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": round(wall, 2), **summary["startup_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for variant in VARIANTS if r % 2 == 0 else reversed(list(VARIANTS)):
                row = run_once(variant, Path(tmp))
                runs[variant].append(row)
                print(variant, json.dumps(row), flush=True)
    median = {v: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for v, rows in runs.items()}
    result = {
        "command": "cd <repo> && .venv/bin/python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine_cpus": os.cpu_count(),
        "variants": {v: VARIANTS[v] or "launcher default" for v in VARIANTS},
        "earlier": "no-prestart experiment (enable_worker_prestart=false) on 2026-11-22: 81.2 s vs 70.9 s to "
        "the first step with Ray's defaults (slower; not adopted)",
        "median": median,
        "runs": runs,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(median, indent=2))


if __name__ == "__main__":
    main()
