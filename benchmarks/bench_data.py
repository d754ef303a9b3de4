"""Ray Data input benchmark. Writes benchmarks/results/data.json.

    .venv/bin/python benchmarks/bench_data.py

(1) delivery: rows/s and tokens/s one replica's stream delivers on its own (read, pack,
    slice), at dp=2 for replica 0, over the shipped corpus prepared by prepare-data;
(2) waiting: at (dp, tp, pp) = (2, 2, 2), the fraction of each rank's step time spent
    waiting for its batch (after step 0), the largest over all 8 ranks (target < 5%).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import ray

from raytrain_hybrid.config import load_config
from raytrain_hybrid.data.ray_data import build_dataset, ordered_iterator
from raytrain_hybrid.data.stream import replica_stream
from raytrain_hybrid.launch.plan.inputs import prepare_input
from raytrain_hybrid.launch.runtime.driver import run

OUT = Path(__file__).resolve().parent / "results" / "data.json"


def delivery(steps: int = 40) -> dict:
    cfg = prepare_input(load_config(None, ["train.global_batch_size=16"]))
    stream = replica_stream(cfg, ordered_iterator(build_dataset(cfg)), dp=2, dp_rank=0)
    it = iter(stream)
    next(it)  # start-up of the streaming executor is not delivery
    t0 = time.perf_counter()
    rows = sum(next(it).shape[0] for _ in range(steps))
    elapsed = time.perf_counter() - t0
    return {
        "replica_rows_per_s": rows / elapsed,
        "replica_tokens_per_s": rows * (cfg.model.seq_len + 1) / elapsed,
        "rows": rows,
        "seconds": elapsed,
    }


def waiting(steps: int = 20) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"train.steps={steps}", f"run.output_dir={tmp}", "run.progress=false"])
        summary = run(cfg)
        history = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    steady = history[1:]
    rank0 = sum(h["data_wait_s"] for h in steady) / sum(h["data_wait_s"] + h["step_time_s"] for h in steady)
    return {
        "layout": summary["layout"],
        "steps": steps,
        "rank0_wait_fraction": rank0,
        "max_rank_wait_fraction": summary["data_wait_fraction"],
        "per_rank": [{k: r[k] for k in ("rank", "pp", "dp", "tp", "data_wait_fraction")} for r in summary["per_rank"]],
        "mean_tokens_per_s": summary["mean_tokens_per_s"],
        "target": 0.05,
    }


def main() -> None:
    ray.init(address="local", num_cpus=9, include_dashboard=False, log_to_driver=False)
    results = {
        "command": "cd <repo> && " + " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "delivery": delivery(),
        "waiting": waiting(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results["waiting"].items() if k != "per_rank"}, indent=2))
    print(json.dumps(results["delivery"], indent=2))


if __name__ == "__main__":
    main()
