"""Loading a pretrained Hugging Face checkpoint into a sharded layout (model.pretrained).

    .venv/bin/python benchmarks/bench_pretrained_load.py [--hidden 1024 --layers 12 --vocab 32000]
        [--zero 0] [--ckpt DIR]

Writes a Llama checkpoint with transformers' ``save_pretrained`` (bf16, the dtype published
checkpoints use, in ~200 MB safetensors shards; 221M parameters by default: 442 MB on disk,
884 MB as the engine's fp32 weights), then builds the engine's Trainer from it at
(dp, tp, pp) = (2, 2, 2) in 8 gloo processes (engine.trainer.Trainer, as a Ray Train worker
does, without Ray). Per rank:

- ``load_s``: seconds in ``checkpoint.hf_load.load_hf_weights`` (reading this rank's slices),
  and ``build_s``: the whole Trainer construction (meta build, TP/FSDP, materialise, load);
- ``share_bytes``: the bytes of the parameter shards the rank holds (fp32);
- ``peak_rss_bytes``: the largest rise of the process's resident memory (VmRSS, sampled every
  2 ms by a thread) during the construction over its value just before, and the same for
  anonymous memory only (RssAnon: without the checkpoint file's pages mapped while read);
- ``ratio`` = peak rise / share (goal <= 1.5), for VmRSS and for RssAnon.

``--zero 3`` shards the weights over dp too (FSDP2), halving each share. ``--reader mmap``
measures torch's HuggingFaceStorageReader unchanged (safetensors' memory-mapped slices), which
the engine's reader replaces with plain ranged reads (checkpoint.hf_reader.RangeReader).
Result: benchmarks/results/pretrained_load.json (with the command that made it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"


def make_checkpoint(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=32 * ((8 * hidden // 3 + 31) // 32),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size="200MB")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """The peak of VmRSS and RssAnon while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = _status()
        self.peak = dict(self.base)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for k, v in _status().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.002)

    def stop(self) -> dict:
        self.done.set()
        self.join()
        return {k: self.peak[k] - self.base[k] for k in ("VmRSS", "RssAnon")}


def _worker(rank: int, world: int, port: int, overrides: list[str], reader: str, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from raytrain_hybrid.checkpoint import hf_load
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
    from raytrain_hybrid.engine import trainer as trainer_mod

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, overrides)
    dims = ParallelDims.from_config(cfg.parallelism)
    mesh = dims.build_mesh("cpu", arrange_ranks(dims, ["n"] * world))
    load_s = []
    inner = hf_load.load_hf_weights

    def timed(*args, **kwargs):
        t = time.perf_counter()
        inner(*args, **kwargs)
        load_s.append(time.perf_counter() - t)

    trainer_mod.load_hf_weights = timed  # this process only
    if reader == "mmap":  # torch's reader as it is (safetensors' memory-mapped slices), to compare
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        hf_load.RangeReader = lambda store: HuggingFaceStorageReader(store.path)
    dist.barrier()
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    trainer = trainer_mod.Trainer(cfg, dims, mesh, torch.device("cpu"))
    build_s = time.perf_counter() - t0
    peak = sampler.stop()

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p

    share = sum(local(p).numel() * local(p).element_size() for p in trainer.params)
    row = {
        "rank": rank,
        "stage_blocks": trainer.stage_ids,
        "load_s": round(sum(load_s), 3),
        "build_s": round(build_s, 3),
        "share_bytes": share,
        "peak_rss_bytes": peak["VmRSS"],
        "peak_anon_bytes": peak["RssAnon"],
        "ratio_rss": round(peak["VmRSS"] / share, 3),
        "ratio_anon": round(peak["RssAnon"] / share, 3),
    }
    rows = [None] * world if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--reader", choices=("pread", "mmap"), default="pread", help="mmap: torch's reader unchanged")
    ap.add_argument("--ckpt", default=str(Path(tempfile.gettempdir()) / "raytrain-hybrid-bench-hf"))
    ap.add_argument("--out", default=str(OUT / "pretrained_load.json"))
    args = ap.parse_args()

    ckpt = Path(args.ckpt) / f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}"
    t = time.perf_counter()
    make_checkpoint(ckpt, args.hidden, args.layers, args.vocab)
    print(f"checkpoint {ckpt} ({time.perf_counter() - t:.1f} s)", flush=True)
    layout = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", f"parallelism.zero={args.zero}"]
    overrides = [f"model.pretrained={ckpt}", "model.seq_len=256", "parallelism.microbatches=2", *layout]
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, 8, port, overrides, args.reader, queue)) for r in range(8)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    files = sorted(ckpt.glob("*.safetensors"))
    disk = sum(f.stat().st_size for f in files)
    result = {
        "command": "cd <repo> && .venv/bin/python " + " ".join(["benchmarks/bench_pretrained_load.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine_cpus": os.cpu_count(),
        "layout": {"dp": 2, "tp": 2, "pp": 2, "zero": args.zero},
        "reader": args.reader,
        "load_average_1min_before": load_before,
        "checkpoint": {"files": len(files), "bytes_on_disk": disk, "dtype": "bfloat16"},
        "goal": "peak host memory rise per rank / its share of the model's bytes <= 1.5",
        "max_ratio_rss": max(r["ratio_rss"] for r in rows),
        "max_ratio_anon": max(r["ratio_anon"] for r in rows),
        "max_load_s": max(r["load_s"] for r in rows),
        "max_build_s": max(r["build_s"] for r in rows),
        "per_rank": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_rank"}, indent=2))


if __name__ == "__main__":
    main()
