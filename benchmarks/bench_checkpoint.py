"""Checkpoint benchmark. Writes benchmarks/results/checkpoint.json.

    .venv/bin/python benchmarks/bench_checkpoint.py [--hidden 256 --layers 8]

At (dp, tp, pp) = (2, 2, 2) on local Ray (8 gloo workers), fp32 Llama, corpus in memory:
(1) save: seconds per checkpoint (DCP's write of the shards, and all of it: hashing, manifest,
    rename, barriers) against the step time; (2) load: seconds to load a checkpoint when a run
    resumes at (2, 2, 2) and when it reshards to (1, 1, 1); (3) size: bytes on disk against the
    model's state (fp32 weights and the two AdamW moments, 12 bytes a parameter), and the largest
    per-rank file against an even 1/8 share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from raytrain_hybrid.config import load_config
from raytrain_hybrid.launch.driver import run
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.common import build_stage

OUT = Path(__file__).resolve().parent / "results"


def param_count(cfg) -> int:
    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(cfg.model.num_layers)), first=True, last=True)
    return sum(p.numel() for p in meta.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    model = [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "data.path=memory"]
    layout = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=4"]
    ray.init(address="local", num_cpus=10, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "saved"
        cfg = load_config(None, [*model, *layout, "train.steps=6", "checkpoint.interval=2", "checkpoint.keep=0",
                                 f"run.output_dir={saved}", "run.progress=false"])  # fmt: skip
        summary = run(cfg)
        step4 = saved / "checkpoints" / "step_4"
        manifest = json.loads((step4 / "manifest.json").read_text())
        sizes = {name: d["size"] for name, d in manifest["files"].items()}
        loads = {}
        for name, extra in (("2x2x2", layout), ("1x1x1", ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1",
                                                          "parallelism.microbatches=1"])):  # fmt: skip
            rcfg = load_config(None, [*model, *extra, "train.steps=6", f"run.output_dir={Path(tmp) / name}",
                                      "run.progress=false"])  # fmt: skip
            loads[name] = run(rcfg, resume=str(step4))["startup_s"]["checkpoint_load"]
    params = param_count(cfg)
    state_bytes = params * 12
    shard_sizes = [v for k, v in sizes.items() if k.endswith(".distcp")]
    steps = [c for c in summary["checkpoints"]]
    results = {
        "command": "cd <repo> && " + " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "model": {"hidden_size": args.hidden, "num_layers": args.layers, "params": params},
        "layout": "dp=2 tp=2 pp=2, 1F1B, 4 micro-batches, zero=0",
        "mean_step_time_s": summary["mean_step_time_s"],
        "save": [
            {"step": c["step"], "write_s": round(c["write_s"], 3), "save_s": round(c["save_s"], 3)} for c in steps
        ],
        "median_save_s": statistics.median(c["save_s"] for c in steps),
        "median_write_s": statistics.median(c["write_s"] for c in steps),
        "load_s": loads,
        "bytes_on_disk": sum(sizes.values()),
        "model_state_bytes": state_bytes,
        "disk_over_state": sum(sizes.values()) / state_bytes,
        "largest_rank_file_over_even_share": max(shard_sizes) / (sum(shard_sizes) / len(shard_sizes)),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "checkpoint.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
