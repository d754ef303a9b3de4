"""Core benchmarks (issue: one trainer for every layout). Writes benchmarks/results/core.json.

    .venv/bin/python benchmarks/bench_core.py            # all three parts, ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_core.py --parts compile

(a) overhead: steady-state step time of (1,1,1) under Ray Train vs a plain PyTorch loop over
    the unmodified transformers model, same model, batch and thread count, run back to back.
(b) memory: per-rank parameter, gradient and optimizer bytes of each layout against the ideal
    share (total / (tp*pp), and / dp for what the ZeRO stage shards).
(c) scaling: tokens/s of dp=2 vs dp=1 at the same global batch on this machine.
(d) compile: steady-state step time with parallelism.compile off and on (each transformer block
    under torch.compile, inductor's C++ backend) at (1,1,1), (2,1,2) and (2,2,2) (--compile-layouts;
    rows not re-measured are kept), the default model, and the compile's seconds in the first
    step; inductor's cache starts empty (a fresh directory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from raytrain_hybrid.config import load_config
from raytrain_hybrid.data.corpus import TokenWindows, tokenize_corpus
from raytrain_hybrid.launch.runtime.driver import run
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.common import build_stage, full_init_state_dict

OUT = Path(__file__).resolve().parent / "results" / "core.json"
WARMUP = 3


def _cfg(overrides, out_dir):
    return load_config(None, [*overrides, f"run.output_dir={out_dir}", "run.progress=false"])


def plain_loop_step_times(cfg) -> list[float]:
    """The same model and batches in one process: HF forward, loss, backward, clip, AdamW."""
    spec = get_arch(cfg.model.arch)
    hf_config = spec.hf_config(cfg)
    import transformers

    model = transformers.LlamaForCausalLM(hf_config)
    meta = build_stage(spec, hf_config, list(range(cfg.model.num_layers)), first=True, last=True)
    shapes = {n: p.shape for n, p in meta.named_parameters()}
    model.load_state_dict(
        spec.to_hf(full_init_state_dict(meta, cfg.train.seed, cfg.train.init_std, shapes)), strict=False
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = TokenWindows(tokenize_corpus(), cfg.model.seq_len, cfg.train.seed)
    times = []
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        batch = data.rows_to_batch(data.global_rows(step, cfg.train.global_batch_size))
        logits = model(input_ids=batch.input_ids).logits
        F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def ray_step_times(overrides, tmp) -> tuple[list[float], dict]:
    out = Path(tmp) / "_".join(o.split("=")[-1] for o in overrides)[:80]
    summary = run(_cfg(overrides, out))
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [h["step_time_s"] for h in history], summary


def bench_overhead(tmp, steps: int, threads: int) -> dict:
    layout = [
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.microbatches=1",
        f"train.steps={steps}",
        f"cluster.cpus_per_worker={threads}",
    ]
    torch.set_num_threads(threads)
    rounds = []
    for _ in range(2):  # alternate, so drift in machine load hits both sides
        ray_times, _ = ray_step_times(layout, tmp)
        plain_times = plain_loop_step_times(_cfg(layout, Path(tmp) / "plain"))
        ray_s = statistics.median(ray_times[WARMUP:])
        plain_s = statistics.median(plain_times[WARMUP:])
        rounds.append({"ray_step_s": ray_s, "plain_step_s": plain_s, "ratio": ray_s / plain_s})
    return {
        "torch_threads": threads,
        "steps": steps,
        "rounds": rounds,
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "target": 1.05,
    }


LAYOUTS = {
    "1x1x1": ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"],
    "2x1x1": ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=2"],
    "1x2x1": ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1"],
    "1x1x2-gpipe": [
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.schedule=GPipe",
        "parallelism.microbatches=2",
    ],
    "1x1x2-1f1b": ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2", "parallelism.microbatches=2"],
    "2x2x1": ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=2"],
    "2x1x2": ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=2", "parallelism.microbatches=2"],
    "1x2x2": ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=2"],
    "2x2x2": ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=4"],
    "2x1x1-zero1": [
        "parallelism.dp=2",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.microbatches=2",
        "parallelism.zero=1",
    ],
    "2x2x2-zero1": [
        "parallelism.dp=2",
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.microbatches=4",
        "parallelism.zero=1",
    ],
    "2x1x1-zero3": [
        "parallelism.dp=2",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.microbatches=2",
        "parallelism.zero=3",
    ],
    "2x2x2-zero3": [
        "parallelism.dp=2",
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.microbatches=4",
        "parallelism.zero=3",
    ],
    "gpt2-2x2x2": [
        "model.arch=gpt2",
        "parallelism.dp=2",
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.microbatches=4",
    ],
}


def total_param_count(cfg) -> int:
    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(cfg.model.num_layers)), first=True, last=True)
    return sum(p.numel() for p in meta.parameters())


def bench_memory(tmp, only: list[str] | None = None, previous: dict | None = None) -> dict:
    """``only``: re-measure these layouts and keep the other rows of ``previous``."""
    out = dict((previous or {}).get("layouts", {})) if only else {}
    for name, layout in LAYOUTS.items():
        if only and name not in only:
            continue
        _, summary = ray_step_times([*layout, "train.steps=2"], tmp)
        cfg = _cfg(layout, tmp)
        par = cfg.parallelism
        full = total_param_count(cfg) * 4  # fp32 bytes
        split = par.tp * par.pp
        ideal = {
            "param_bytes": full / split / (par.dp if par.zero == 3 else 1),
            "grad_bytes": full / split / (par.dp if par.zero >= 2 else 1),
            "optimizer_bytes": 2 * full / split / (par.dp if par.zero >= 1 else 1),  # AdamW: two moments
        }
        measured = {k: summary[k] for k in ideal}
        ratios = {k: measured[k] / ideal[k] for k in ideal}
        out[name] = {
            "layout": summary["layout"],
            "total_param_bytes": full,
            "measured_max_per_rank": measured,
            "ideal_per_rank": ideal,
            "ratio": ratios,
            "ratio_sum": sum(measured.values()) / sum(ideal.values()),
        }
    return {"layouts": out, "target": 1.10}


def bench_scaling(tmp, steps: int) -> dict:
    res = {}
    for dp in (1, 2):
        layout = [
            f"parallelism.dp={dp}",
            "parallelism.tp=1",
            "parallelism.pp=1",
            "parallelism.microbatches=1",
            f"train.steps={steps}",
            "train.global_batch_size=16",
        ]
        times, summary = ray_step_times(layout, tmp)
        tokens = 16 * 128  # global batch x seq_len per step
        res[f"dp{dp}"] = {
            "median_step_s": statistics.median(times[WARMUP:]),
            "tokens_per_s": tokens / statistics.median(times[WARMUP:]),
        }
    res["speedup_dp2_over_dp1"] = res["dp2"]["tokens_per_s"] / res["dp1"]["tokens_per_s"]
    return res


def bench_compile(tmp, steps: int, names: list[str], previous: dict | None, command: str) -> dict:
    out = dict((previous or {}).get("layouts", {}))
    for name in names:
        # The machine is shared: its load before and after the row says how far to trust it.
        row = {"command": command, "load_average_1min": {"before": os.getloadavg()[0]}}
        for on in (False, True):
            times, summary = ray_step_times([*LAYOUTS[name], f"train.steps={steps}", f"parallelism.compile={on}"], tmp)
            row["compile_on" if on else "compile_off"] = {
                "median_step_s": statistics.median(times[WARMUP:]),
                "first_step_s": times[0],
                "startup_s": summary["startup_s"],  # first_step_compile: the compile's share of first_step
            }
        row["load_average_1min"]["after"] = os.getloadavg()[0]
        row["ratio_on_over_off"] = row["compile_on"]["median_step_s"] / row["compile_off"]["median_step_s"]
        out[name] = row
    return {
        "layouts": out,
        "steps": steps,
        "warmup_steps_left_out": WARMUP,
        "inductor": {"cache": "empty at the start", "compile_threads": os.environ["TORCHINDUCTOR_COMPILE_THREADS"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="overhead,memory,scaling")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--layouts", default="", help="memory part: only these LAYOUTS names (comma-separated)")
    parser.add_argument("--compile-layouts", default="1x1x1,2x1x2,2x2x2", help="compile part: these LAYOUTS names")
    args = parser.parse_args()
    if "compile" in args.parts:  # before Ray starts: its workers inherit this environment
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-core-inductor-")
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # a worker has one CPU
    import ray

    ray.init(address="local", num_cpus=9, include_dashboard=False, log_to_driver=False)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results["command"] = "cd <repo> && " + " ".join([".venv/bin/python", *sys.argv])
    results["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "ray": ray.__version__,
    }
    results["date"] = time.strftime("%Y-%m-%d")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    parts = {
        "overhead": ("overhead_1x1x1", lambda tmp: bench_overhead(tmp, args.steps, threads=2)),
        "memory": (
            "memory",
            lambda tmp: bench_memory(tmp, [x for x in args.layouts.split(",") if x], results.get("memory")),
        ),
        "scaling": ("scaling_dp", lambda tmp: bench_scaling(tmp, args.steps)),
        "compile": (
            "compile",
            lambda tmp: bench_compile(
                tmp, args.steps, args.compile_layouts.split(","), results.get("compile"), results["command"]
            ),
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            key, fn = parts[part]
            results[key] = {**fn(tmp), "command": results["command"], "date": results["date"]}
            OUT.write_text(json.dumps(results, indent=2) + "\n")  # keep what finished
    print(json.dumps({k: v for k, v in results.items() if k != "memory"}, indent=2))
    if "memory" in results:
        for name, row in results["memory"]["layouts"].items():
            print(f"{name:>14}  " + "  ".join(f"{k}={v:.3f}" for k, v in row["ratio"].items()))
    assert math.isfinite(results.get("scaling_dp", {}).get("speedup_dp2_over_dp1", 1.0))


if __name__ == "__main__":
    main()
