"""Where the quick start's time goes: its steps 10 to 12 traced (run.profile_steps) and read.

    python benchmarks/bench_profile.py          # -> benchmarks/results/profile.json

Runs the README's quick start as a user would (``raytrain-hybrid train``, Ray, dp=2 tp=2 pp=2 on
8 CPU workers) with ``--set run.profile_steps=10,12``, then reads every rank's trace with
benchmarks/trace_ops.py: the traced steps' times, the CPU time by kind (matmuls, attention,
collectives, waiting for one, Python between ops) and the top ops by self time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROOT = HERE.parent
OUT = HERE / "results" / "profile.json"
TRAIN = [str(ROOT / ".venv" / "bin" / "raytrain-hybrid"), "train", "--set", "run.profile_steps=10,12"]


def main(argv: list[str] | None = None) -> None:
    import trace_ops

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        done = subprocess.run([*TRAIN, "--set", f"run.output_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode:
            sys.exit(f"the quick start failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        traces = sorted((Path(run_dir) / "profile").glob("trace_rank*.json"), key=lambda p: int(p.stem[10:]))
        ranks = {
            p.stem[len("trace_rank") :]: {"trace_bytes": p.stat().st_size, **trace_ops.read(p, top=8)} for p in traces
        }
    record = {
        "command": "cd <repo> && .venv/bin/python benchmarks/bench_profile.py",
        "date": time.strftime("%Y-%m-%d"),
        "hardware": f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU, shared with other work",
        "run": "the quick start: " + " ".join(["raytrain-hybrid", *TRAIN[1:]]),
        "wall_s": round(wall, 1),
        "mean_tokens_per_s": summary["mean_tokens_per_s"],
        "mean_step_time_s": summary["mean_step_time_s"],
        "ranks": ranks,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({r: v["cpu_by_kind"][:4] for r, v in ranks.items()}, indent=1))


if __name__ == "__main__":
    main()
