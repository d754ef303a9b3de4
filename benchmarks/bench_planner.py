"""Planner vs measurement on this machine. Writes benchmarks/results/planner.json.

    .venv/bin/python benchmarks/bench_planner.py

Calibrates this machine (matmul, gloo), then measures 8 layouts of 4 ranks with the Ray Tune
sweep (small Llama, in-memory corpus, 10 steps each) and compares with the cost model:
per-rank parameter + gradient + optimizer bytes (target: within 10 %) and the Spearman rank
correlation of predicted vs measured tokens/s (target: >= 0.7).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import ray

from raytrain_hybrid.config import load_config
from raytrain_hybrid.planner.calibrate import calibrate
from raytrain_hybrid.planner.hardware import load_hardware
from raytrain_hybrid.tools.sweep import rank_correlation, sweep

OUT = Path(__file__).resolve().parent / "results"
LAYOUTS = [
    {"dp": 4, "tp": 1, "pp": 1, "zero": 0},
    {"dp": 4, "tp": 1, "pp": 1, "zero": 3},
    {"dp": 2, "tp": 2, "pp": 1, "zero": 0},
    {"dp": 2, "tp": 1, "pp": 2, "schedule": "1F1B", "microbatches": 2, "zero": 0},
    {"dp": 1, "tp": 4, "pp": 1},
    {"dp": 1, "tp": 2, "pp": 2, "schedule": "1F1B", "microbatches": 4},
    {"dp": 1, "tp": 1, "pp": 4, "schedule": "GPipe", "microbatches": 4},
    {"dp": 1, "tp": 1, "pp": 4, "schedule": "1F1B", "microbatches": 8},
]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    profile_path = OUT / "local_profile.json"
    profile = calibrate(profile_path)
    hw = load_hardware(str(profile_path))
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    cfg = load_config(None, ["data.path=memory", "train.global_batch_size=16", "model.num_layers=4"])
    with tempfile.TemporaryDirectory() as tmp:
        rows = sweep(cfg, 4, hw, top=len(LAYOUTS), steps=10, out_dir=Path(tmp), only=LAYOUTS)
    ok = [r for r in rows if not r["failed"]]
    for r in ok:
        measured = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        r["state_bytes_error"] = r["predicted_state_bytes"] / measured - 1
    rho = rank_correlation(ok)
    results = {
        "command": "cd <repo> && " + " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "profile": profile,
        "layouts": rows,
        "max_abs_state_bytes_error": max(abs(r["state_bytes_error"]) for r in ok),
        "spearman_tokens_per_s": rho,
        "targets": {"state_bytes_error": 0.10, "spearman": 0.7},
    }
    (OUT / "planner.json").write_text(json.dumps(results, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['name']:>36}  predicted {r['predicted_tokens_per_s']:>10,.0f}  measured "
            f"{r['measured_tokens_per_s'] or 0:>10,.0f}  state err {r.get('state_bytes_error', float('nan')):+.3f}"
        )
    print(f"spearman {rho:.3f}  max state error {results['max_abs_state_bytes_error']:.3f}")


if __name__ == "__main__":
    main()
