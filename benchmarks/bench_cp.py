"""Context-parallelism benchmark: activation memory per rank at seq 4096, cp = 1, 2 and 4.

    .venv/bin/python benchmarks/bench_cp.py

A Llama stage (hidden 256, 8 heads, 2 kv heads, 2 blocks, the LM head, fp32, one row of 4096
tokens) as gloo processes on this CPU, each cp rank running the engine's stage on its slice of
the row (as Trainer does), attention exchanging heads by all-to-all. "Activation memory" is
measured exactly as in bench_sp.py: the bytes of every tensor autograd saves for backward
during one forward (saved_tensors_hooks, each storage counted once), what a rank holds between
forward and backward; the largest rank's. Compared with the planner's activation_bytes (its
16-bit formula at 4-byte width, logits included). Writes benchmarks/results/cp.json.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

from bench_sp import _port, _saved_bytes  # (benchmarks/ is on sys.path when this file runs)

OUT = Path(__file__).resolve().parent / "results" / "cp.json"
SEQ = 4096
MODEL = [
    "model.hidden_size=256",
    "model.num_heads=8",
    "model.num_kv_heads=2",
    f"model.seq_len={SEQ}",
    "model.num_layers=2",
    "model.vocab_size=8192",
]
BATCH = 1


def _overrides(cp: int) -> list[str]:
    return [
        *MODEL,
        "parallelism.dp=1",
        f"parallelism.cp={cp}",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.microbatches=1",
        f"train.global_batch_size={BATCH}",
    ]


def _worker(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.distributed.context_parallel import local_slice
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims
    from raytrain_hybrid.engine.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, _overrides(world))
    dims = ParallelDims.from_config(cfg.parallelism)
    trainer = Trainer(cfg, dims, dims.build_mesh("cpu", list(range(world))), torch.device("cpu"))
    (module,) = trainer.modules
    x = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    x = local_slice(x, world, trainer.cp_rank)  # this rank's tokens, as Trainer._cp_slice cuts them
    _saved_bytes(module, x)  # warm-up
    t0 = time.perf_counter()
    saved = _saved_bytes(module, x)
    queue.put((rank, saved, time.perf_counter() - t0))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(cp: int) -> tuple[int, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return max(g[1] for g in got), max(g[2] for g in got)


def main() -> None:
    import dataclasses

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.planner.cost import activation_bytes

    rows = {}
    for cp in (1, 2, 4):
        t0 = time.time()
        measured, forward_s = measure(cp)
        cfg = load_config(None, _overrides(cp))
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype="float32"))
        rows[f"cp{cp}"] = {
            "measured_saved_bytes_per_rank": measured,
            "planner_bytes_per_rank": activation_bytes(cfg, BATCH),
            "forward_s": round(forward_s, 3),
            "seconds": round(time.time() - t0, 1),
        }
        print(cp, rows[f"cp{cp}"], flush=True)
    one = rows["cp1"]["measured_saved_bytes_per_rank"]
    result = {
        "command": "cd <repo> && .venv/bin/python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "hardware": f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo (cp ranks as processes)",
        "model": {"hidden": 256, "heads": 8, "kv_heads": 2, "seq_len": SEQ, "batch": BATCH, "layers": 2},
        "rows": rows,
        "cp2_over_cp1": rows["cp2"]["measured_saved_bytes_per_rank"] / one,
        "cp4_over_cp1": rows["cp4"]["measured_saved_bytes_per_rank"] / one,
        "planner_cp2_over_cp1": rows["cp2"]["planner_bytes_per_rank"] / rows["cp1"]["planner_bytes_per_rank"],
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
