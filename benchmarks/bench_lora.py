"""LoRA's optimizer memory per rank against the adapters' share, and against a full fine-tune.

    .venv/bin/python benchmarks/bench_lora.py

A Llama written by transformers' ``save_pretrained`` (hidden 256, MLP 512, 4 blocks, 4 heads,
2 key/value heads, vocabulary 4096, fp32), fine-tuned two steps from it with LoRA (rank 8,
every linear of every block) and, for comparison, fully, at 1x1x1 and at four 4-rank layouts
(TP with sequence parallelism and PP, TP with ZeRO-1, FSDP with PP, DDP-style replication),
as gloo processes (tests/gloo_harness.py: the worker code Ray Train runs). Per rank:

- ``optimizer_bytes``: every tensor of the AdamW state the rank holds (Trainer.memory_stats);
- the adapters' share: 8 bytes (two fp32 moments) for each adapter element this rank's
  optimizer updates: its local adapter shards after TP and FSDP, divided by dp under ZeRO-1
  (without padding). Replicated adapters (A of a column-parallel linear, B of a row-parallel
  one) are whole on every TP rank, so each holds their moments, as it holds those of the
  norms in a full fine-tune;
- ratio = optimizer_bytes / share (goal <= 1.05: nothing for the base; the rest is AdamW's
  per-parameter step counter and ZeRO-1's padding).

Writes benchmarks/results/lora.json.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "lora.json"
sys.path.insert(0, str(ROOT / "tests"))  # gloo_harness: the engine's worker code in forked gloo ranks

LAYOUTS = {
    "1x2x2-sp": ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2"],
    "2x2x1-zero1": ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=1", "parallelism.zero=1"],
    "2x1x2-zero3": ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=2", "parallelism.zero=3"],
    "4x1x1-zero0": ["parallelism.dp=4", "parallelism.tp=1", "parallelism.pp=1"],
}
SINGLE = {"1x1x1": ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"]}
LORA = ["lora.rank=8", "lora.alpha=16", "lora.targets=all-linear"]


def checkpoint(root: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    out = root / "llama"
    tf.LlamaForCausalLM(config).save_pretrained(out)
    return out


def _body(rank: int, world: int, jobs: dict) -> dict:
    """gloo_harness's job runner, with each rank also reporting the adapter elements its optimizer updates."""
    import gloo_harness
    from torch.distributed.tensor import DTensor

    from raytrain_hybrid.distributed.zero1 import ZeroOneOptimizer
    from raytrain_hybrid.engine.trainer import Trainer

    stats = Trainer.memory_stats

    def memory_stats(trainer) -> dict:
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.params)
        zero1 = isinstance(trainer.optimizer, ZeroOneOptimizer)
        return {**stats(trainer), "trained_elements": local / (trainer.dims.dp if zero1 else 1)}

    Trainer.memory_stats = memory_stats
    return gloo_harness._run_jobs(rank, world, jobs)


def main() -> None:
    from gloo_harness import launch_ranks

    with tempfile.TemporaryDirectory() as tmp:
        src = checkpoint(Path(tmp))
        common = [f"model.pretrained={src}", "data.path=memory", "model.seq_len=64", "train.steps=2",
                  "train.global_batch_size=8", "parallelism.microbatches=2"]  # fmt: skip
        runs = {}
        for world, layouts in ((1, SINGLE), (4, LAYOUTS)):
            jobs = {}
            for name, layout in layouts.items():
                jobs[f"lora {name}"] = [*common, *layout, *LORA, f"run.output_dir={tmp}/lora-{name}"]
                jobs[f"full {name}"] = [*common, *layout, f"run.output_dir={tmp}/full-{name}"]
            t0 = time.perf_counter()
            runs.update(launch_ranks(_body, world, jobs))
            print(f"{world} rank(s): {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for name in [*SINGLE, *LAYOUTS]:
        lora, full = runs[f"lora {name}"]["memory"], runs[f"full {name}"]["memory"]
        for mine, whole in zip(lora, full, strict=True):
            share = 8 * mine["trained_elements"]
            rows.append({
                "layout": name, "rank": mine["rank"],
                "optimizer_bytes": mine["optimizer_bytes"], "adapter_share_bytes": share,
                "ratio": round(mine["optimizer_bytes"] / share, 4),
                "full_finetune_optimizer_bytes": whole["optimizer_bytes"],
                "lora_over_full": round(mine["optimizer_bytes"] / whole["optimizer_bytes"], 4),
                "param_bytes": mine["param_bytes"], "grad_bytes": mine["grad_bytes"],
                "full_finetune_grad_bytes": whole["grad_bytes"],
            })  # fmt: skip
            print(rows[-1], flush=True)
    worst = max(r["ratio"] for r in rows)
    result = {
        "command": "cd <repo> && .venv/bin/python benchmarks/bench_lora.py",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "time_utc": time.strftime("%H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, CPU only (gloo)",
        "model": "Llama from save_pretrained: hidden 256, MLP 512, 4 blocks, 4 heads, 2 kv heads, vocab 4096, fp32",
        "lora": "rank 8, alpha 16, targets all-linear (7 linears a block)",
        "definitions": (
            "adapter_share_bytes = 8 bytes (AdamW's two fp32 moments) x the adapter elements the rank's optimizer "
            "updates (local shards after TP and FSDP; / dp under ZeRO-1, unpadded); ratio = optimizer_bytes / "
            "adapter_share_bytes; lora_over_full = the LoRA run's optimizer bytes / the full fine-tune's, same rank"
        ),
        "goal": "ratio <= 1.05",
        "worst_ratio": worst,
        "meets_goal": worst <= 1.05,
        "rows": rows,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"worst ratio {worst}; wrote {OUT}")


if __name__ == "__main__":
    main()
