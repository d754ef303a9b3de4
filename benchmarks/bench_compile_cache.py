"""Compile warm starts (issue 49, section 4): the first step's torch.compile time of a compiled run
started cold, against a restart of it that finds the run's compile cache (engine.compile_cache).

    python benchmarks/bench_compile_cache.py            # -> benchmarks/results/compile_cache.json
    python benchmarks/bench_compile_cache.py --layouts 1x1x1 --out /tmp/cc.json

Per layout, gloo processes without Ray (tests/gloo_harness.py), each launch with an empty inductor
cache directory of its own (TORCHINDUCTOR_CACHE_DIR), as a fresh node has:

- cold: a compiled run of 2 steps, checkpoint after step 1, into run directory D;
- warm: a restart of it (a resume from D's step_1 into D): new processes, a new empty inductor
  cache, only what D holds. Its first step compiles again, with the artifacts loaded.

Compile seconds are the engine's own count (engine.compile_clock: dynamo's compile callbacks) in
the first step of each; the goal is warm <= 20 % of cold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "benchmarks" / "results" / "compile_cache.json"
COMMON = (
    "train.steps=2",
    "checkpoint.interval=1",
    "parallelism.compile=true",
    "parallelism.compile_cache=true",
    "data.path=memory",
)


def layout(name: str) -> list[str]:
    dp, tp, pp = (int(x) for x in name.split("x"))
    micro = 2 if pp > 1 else 1
    return [f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.microbatches={micro}"]


def first_step(result: dict) -> dict:
    h = result["history"][0]
    return {
        "step": h["step"],
        "compile_s": h["compile_s"],
        "compiles": h["compiles"],
        "step_time_s": round(h["step_time_s"], 3),
        "cache_files_loaded": result["marks"].get("compile_cache_loaded"),
    }


def run_layout(name: str, work: Path) -> dict:
    from gloo_harness import run_gloo

    work.mkdir(parents=True)
    run_dir = work / name / "run"
    sets = [*COMMON, *layout(name), f"run.output_dir={run_dir}"]
    cold_env = {"TORCHINDUCTOR_CACHE_DIR": str(work / name / "inductor_cold")}
    cold = first_step(run_gloo(sets, env=cold_env))
    files = sorted(p.name for p in (run_dir / "compile_cache").iterdir())
    warm_env = {"TORCHINDUCTOR_CACHE_DIR": str(work / name / "inductor_warm")}
    warm = first_step(run_gloo(sets, resume=str(run_dir / "checkpoints" / "step_1"), env=warm_env))
    size = sum((run_dir / "compile_cache" / f).stat().st_size for f in files)
    return {
        "cold": cold,
        "warm": warm,
        "warm_over_cold_compile": round(warm["compile_s"] / cold["compile_s"], 3),
        "cache_files": files,
        "cache_bytes": size,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="1x1x1,2x1x2", help="dp x tp x pp, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="cold/warm pairs per layout (the host's load varies)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    import torch

    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.layouts.split(","):
            runs = [run_layout(name, Path(work) / f"{name}_{i}") for i in range(args.repeat)]
            ratios = sorted(r["warm_over_cold_compile"] for r in runs)
            rows[name] = {"median_warm_over_cold_compile": ratios[len(ratios) // 2], "runs": runs}
            print(name, json.dumps(rows[name]), flush=True)
    out = {
        "command": "cd <repo> && " + " ".join(["python", "benchmarks/bench_compile_cache.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU (inductor's C++ backend)",
        "torch": torch.__version__,
        "model": "default (llama, config defaults), train.steps=2, checkpoint after step 1",
        "goal": "warm restart's first-step compile time <= 20 % of the cold start's",
        "layouts": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
