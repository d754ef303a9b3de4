"""Sequence-parallelism benchmark: activation memory per rank with and without SP.

    .venv/bin/python benchmarks/bench_sp.py

Llama stage (hidden 512, seq 512, batch 4, 2 blocks, fp32) at tp=2 (and tp=1 for scale), as
gloo processes. "Activation memory" is measured exactly: the bytes of every tensor autograd
saves for backward during one forward (saved_tensors_hooks, each storage counted once),
i.e. what a rank holds between forward and backward. Compared with the planner's
Korthikanti et al. model (layer_activation_bytes, 4-byte activations, logits apart).
Writes benchmarks/results/sp.json.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "sp.json"
MODEL = ["model.hidden_size=512", "model.num_heads=8", "model.seq_len=512", "model.num_layers=2"]
BATCH = 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _saved_bytes(module, x) -> int:
    """Bytes of the tensors autograd saves for backward during one forward."""
    import torch
    from torch.distributed.tensor import DTensor

    def storage(t) -> tuple[int, int]:
        """(key, bytes) of the memory behind t, through DTensor and collective wrappers."""
        base = t._local_tensor if isinstance(t, DTensor) else t
        base = getattr(base, "elem", base)  # AsyncCollectiveTensor (functional collectives)
        try:
            st = base.untyped_storage()
            return st.data_ptr(), st.nbytes()
        except RuntimeError:
            return id(base), base.numel() * base.element_size()

    # Parameters (and views of them, e.g. a transposed weight) are not activations.
    seen: set[int] = {storage(p)[0] for p in module.parameters()}
    total = [0]

    def pack(t):
        key, nbytes = storage(t)
        if key not in seen:
            seen.add(key)
            total[0] += nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    del out
    return total[0]


def _worker(rank: int, world: int, port: int, overrides: list[str], queue) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims
    from raytrain_hybrid.engine.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, overrides)
    par = cfg.parallelism
    dims = ParallelDims.from_config(par)
    mesh = dims.build_mesh("cpu", list(range(world)))
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    (module,) = trainer.modules
    x = torch.randint(0, cfg.model.vocab_size, (BATCH, cfg.model.seq_len))
    _saved_bytes(module, x)  # warm-up (DTensor sharding-propagation caches)
    # Without the head: the logits are the same with or without SP (gathered for the loss).
    head, module.lm_head = module.lm_head, torch.nn.Identity()
    saved = _saved_bytes(module, x)
    module.lm_head = head
    queue.put((rank, saved))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(tp: int, sp: bool) -> int:
    overrides = [
        *MODEL,
        "parallelism.dp=1",
        f"parallelism.tp={tp}",
        "parallelism.pp=1",
        "parallelism.microbatches=1",
        f"parallelism.sequence_parallel={str(sp).lower()}",
        f"train.global_batch_size={BATCH}",
    ]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, tp, port, overrides, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return max(got.values())


def main() -> None:
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.planner.cost import layer_activation_bytes

    cfg = load_config(None, [*MODEL, "parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1"])
    s, h, layers = cfg.model.seq_len, cfg.model.hidden_size, cfg.model.num_layers
    rows = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        t0 = time.time()
        measured = measure(tp, sp)
        # fp32: twice the formula's 16-bit bytes; the embedding output counts as one more s*b*h.
        predicted = 2 * layers * layer_activation_bytes(s, BATCH, h, tp, sp=sp and tp > 1, checkpointed=False)
        rows[f"tp{tp}-{'sp' if sp else 'nosp'}"] = {
            "measured_saved_bytes_per_rank": measured,
            "planner_bytes_per_rank": predicted,
            "seconds": round(time.time() - t0, 1),
        }
        print(tp, sp, measured, predicted, flush=True)
    result = {
        "command": "cd <repo> && .venv/bin/python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "model": {"hidden": h, "seq_len": s, "batch": BATCH, "layers": layers, "dtype": "float32"},
        "rows": rows,
        "sp_over_nosp_at_tp2": rows["tp2-sp"]["measured_saved_bytes_per_rank"]
        / rows["tp2-nosp"]["measured_saved_bytes_per_rank"],
        "planner_sp_over_nosp_at_tp2": rows["tp2-sp"]["planner_bytes_per_rank"]
        / rows["tp2-nosp"]["planner_bytes_per_rank"],
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
