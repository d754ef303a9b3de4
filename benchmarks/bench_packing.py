"""Packing benchmark (data.packing): useful tokens per second, packed / unpacked, on the shipped chat set.

    .venv/bin/python benchmarks/bench_packing.py [--steps 8] [--seq-len 1024]

The shipped chat set (examples/finetune_chat/chat.parquet, 400 conversations) rendered with the
example's ChatML tokenizer (examples/finetune_chat/make_checkpoint.py writes it), at
model.seq_len 1024 on the example's model sizes (Llama, hidden 128, 4 layers, 4 heads, 2 KV heads,
vocabulary 4,104), global batch 8, fp32, one process (layout 1x1x1). Two trainers are built, one
with data.packing=false (one conversation a row, padded) and one with data.packing=true, and they
step in turn (unpacked step k, packed step k), so both see the same machine load. A step's
useful tokens are the labels its loss counts (assistant tokens: non-padding and loss-bearing,
the step's loss_tokens); its time is the trainer's step_time_s (forward, backward, optimizer);
the first step of each is left out (warm-up); the same is also given per CPU second of the
process, which other work on a shared machine does not change. Padding is the share of the model's input
positions that belong to no example (the packed rows' last, all-pad-id segment; unpacked, every
position after the conversation). Writes benchmarks/results/packing.json.
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
OUT = ROOT / "benchmarks" / "results" / "packing.json"
CHAT = ROOT / "examples" / "finetune_chat" / "chat.parquet"
MODEL = [
    "model.arch=llama",
    "model.hidden_size=128",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=352",
    "model.vocab_size=4104",
]


def _tokenizer(out: Path) -> Path:
    """The example checkpoint's tokenizer (the shipped BPE with ChatML tokens and template), as
    examples/finetune_chat/make_checkpoint.py writes it with its small model."""
    sys.path.insert(0, str(ROOT / "examples" / "finetune_chat"))
    from make_checkpoint import main as make_checkpoint

    make_checkpoint(out)
    return out


def padding_positions(batch) -> int:
    """Input positions of a batch that belong to no example."""
    ids = batch.input_ids
    if len(batch.inputs) == 1:  # unpacked: everything after the conversation is padding (id 0)
        real = (ids != 0).long()
        return int((real.flip(-1).cumsum(-1) == 0).sum())  # trailing pad ids of each row
    pad = 0
    for row, pos in zip(ids, batch.inputs[1], strict=True):
        last = int((pos == 0).nonzero().flatten()[-1])
        if last > 0 and not row[last:].any():  # the last segment is padding: all pad id
            pad += len(row) - last
    return pad


def main() -> None:
    import torch
    import torch.distributed as dist

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.data.examples import in_memory_examples
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims
    from raytrain_hybrid.engine.trainer import Trainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    tmp = Path(tempfile.mkdtemp(prefix="bench-packing-"))
    sets = [
        *MODEL,
        f"model.seq_len={args.seq_len}",
        f"train.global_batch_size={args.batch}",
        f"train.steps={args.steps}",
        "train.lr=1e-3",
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.microbatches=1",
        "data.format=chat",
        f"data.path={CHAT}",
        f"data.tokenizer={_tokenizer(tmp / 'tok')}",
    ]
    runs = {}
    for name, packing in (("unpacked", False), ("packed", True)):
        cfg = load_config(None, [*sets, f"data.packing={str(packing).lower()}"])
        dims = ParallelDims.from_config(cfg.parallelism)
        trainer = Trainer(cfg, dims, dims.build_mesh("cpu", [0]), torch.device("cpu"))
        runs[name] = {"cfg": cfg, "trainer": trainer, "next": in_memory_examples(cfg, 1, 0), "steps": []}
    load_before = os.getloadavg()[0]
    for step in range(args.steps):
        for name, run in runs.items():
            batch = run["next"](step)
            cpu = time.process_time()
            metrics = run["trainer"].train_step(step, batch)
            cpu = time.process_time() - cpu
            positions = batch.input_ids.numel()
            run["steps"].append(
                {
                    "step": step,
                    "loss": round(metrics["loss"], 4),
                    "step_time_s": round(metrics["step_time_s"], 3),
                    "cpu_s": round(cpu, 3),
                    "loss_tokens": metrics["loss_tokens"],
                    "input_positions": positions,
                    "padding_positions": padding_positions(batch),
                }
            )
            print(name, run["steps"][-1], flush=True)
    rows = {}
    for name, run in runs.items():
        timed = run["steps"][1:]  # the first step warms up
        seconds = sum(s["step_time_s"] for s in timed)
        useful = sum(s["loss_tokens"] for s in timed)
        rows[name] = {
            "useful_tokens_per_s": round(useful / seconds, 1),
            # The same per CPU second of this process: what the other work on the machine does
            # not change (its wait for the cores is left out).
            "useful_tokens_per_cpu_s": round(useful / sum(s["cpu_s"] for s in timed), 1),
            "seconds_per_step": round(seconds / len(timed), 3),
            "useful_tokens_per_step": round(useful / len(timed), 1),
            "padding_fraction": round(
                sum(s["padding_positions"] for s in run["steps"]) / sum(s["input_positions"] for s in run["steps"]), 4
            ),
            "steps": run["steps"],
        }
    result = {
        "command": "cd <repo> && .venv/bin/python " + " ".join(["benchmarks/bench_packing.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "device": "cpu",
            # Runnable processes (1-minute load average) before and after: other work on the
            # machine shares its cores, the reason the two runs step in turn.
            "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        },
        "setup": {
            "data": "examples/finetune_chat/chat.parquet (400 conversations), ChatML tokenizer",
            "seq_len": args.seq_len,
            "global_batch_size": args.batch,
            "layout": "1x1x1",
            "model": " ".join(m.removeprefix("model.") for m in MODEL),
            "dtype": "float32",
            "steps_each": args.steps,
            "timed_steps_each": args.steps - 1,
        },
        "packed_over_unpacked_useful_tokens_per_s": round(
            rows["packed"]["useful_tokens_per_s"] / rows["unpacked"]["useful_tokens_per_s"], 2
        ),
        "packed_over_unpacked_useful_tokens_per_cpu_s": round(
            rows["packed"]["useful_tokens_per_cpu_s"] / rows["unpacked"]["useful_tokens_per_cpu_s"], 2
        ),
        "packed_padding_fraction": rows["packed"]["padding_fraction"],
        "unpacked_padding_fraction": rows["unpacked"]["padding_fraction"],
        "rows": rows,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
