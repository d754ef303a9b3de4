"""Profiler smoke on one GPU, without Ray: run.profile_steps through the worker loop, then what the
trace says.

    python benchmarks/gpu_profile.py                 # -> benchmarks/results/gpu_profile.json
    python benchmarks/gpu_profile.py --cpu --out /tmp/p.json   # the same on the CPU (a test of the script)

A 0.1B-class Llama (8 layers, hidden 1024, seq 1024, bf16, compiled off) trains 6 steps in a world
of one (NCCL on CUDA, gloo on the CPU) with ``run.profile_steps = [4, 5]``; the script checks that
the trace (and on CUDA the memory snapshot with the planner's prediction beside it) was written,
and records the step times, the top CPU ops and GPU kernels by self time (benchmarks/trace_ops.py)
and, on CUDA, the measured peak against the planner's prediction for the rank.
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
OUT = HERE / "results" / "gpu_profile.json"
SHAPE = {"gpu": ("8", "1024", "16", "8", "2816", "1024", "8"), "cpu": ("2", "64", "4", "2", "192", "32", "4")}
STEPS, PROFILE = 6, (4, 5)


def overrides(kind: str, out: str) -> list[str]:
    layers, hidden, heads, kv, ffn, seq, batch = SHAPE[kind]
    return [
        "model.arch=llama",
        f"model.num_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.num_heads={heads}",
        f"model.num_kv_heads={kv}",
        f"model.ffn_hidden_size={ffn}",
        f"model.seq_len={seq}",
        *("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"),
        f"train.global_batch_size={batch}",
        f"train.steps={STEPS}",
        f"train.dtype={'bfloat16' if kind == 'gpu' else 'float32'}",
        "train.warmup_steps=2",
        "data.path=memory",
        "checkpoint.interval=0",
        f"run.profile_steps={PROFILE[0]},{PROFILE[1]}",
        f"run.output_dir={out}",
    ]


def run(device: torch.device, out_dir: str) -> dict:
    import trace_ops

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
    from raytrain_hybrid.engine.worker import run_worker
    from raytrain_hybrid.launch.runtime.entry import predicted_memory

    cuda = device.type == "cuda"
    cfg = load_config(None, overrides("gpu" if cuda else "cpu", out_dir))
    io = WorkerIO(device=device, predicted_memory=predicted_memory(cfg) if cuda else None)
    t0 = time.perf_counter()
    result = run_worker(WorkerPlan(cfg, use_gpu=cuda), "node0", io)
    wall = time.perf_counter() - t0
    profile = Path(out_dir) / "profile"
    trace = profile / "trace_rank0.json"
    row = {
        "overrides": overrides("gpu" if cuda else "cpu", "<tmp>"),
        "wall_s": round(wall, 2),
        "step_s": [round(h["step_time_s"], 4) for h in result["history"]],
        "files": sorted(p.name for p in profile.iterdir()),
        "trace_bytes": trace.stat().st_size,
        "trace": trace_ops.read(trace, top=10),
    }
    problems = []
    if row["trace"]["steps"] != list(range(PROFILE[0], PROFILE[1] + 1)):
        problems.append(f"the trace holds steps {row['trace']['steps']}, not {list(PROFILE)}")
    if cuda:
        memory = json.loads((profile / "memory_rank0.json").read_text())
        snapshot = pickle.loads((profile / "memory_rank0.pickle").read_bytes())
        row["memory"] = memory
        row["snapshot_segments"] = len(snapshot.get("segments", []))
        if not row["trace"]["top_gpu_kernels"]:
            problems.append("no GPU kernel in the trace")
        if not row["snapshot_segments"]:
            problems.append("the memory snapshot holds no segment")
    row["problems"] = problems
    row["ok"] = not problems
    return row


def main(argv: list[str] | None = None) -> int:
    from gpu_oracle import join_world_of_one, one_gpu_parser, record_header

    args = one_gpu_parser(__doc__, OUT, "run on the CPU, tiny shape (a test of the script)").parse_args(argv)
    if (device := join_world_of_one(args.cpu, "29519", "gpu_profile: --cpu runs the same on the CPU")) is None:
        return 2
    with tempfile.TemporaryDirectory() as out_dir:
        row = run(device, out_dir)
    dist.destroy_process_group()
    record = {**record_header("benchmarks/gpu_profile.py", device), **row}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("ok", "problems", "step_s", "files")}), flush=True)
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
