"""The generic decoder path against transformers' own loop, family by family.

    .venv/bin/python benchmarks/bench_models.py [--steps 10] [--rounds 3] [--only qwen3,gemma2] [--memory]

For each family of tests/test_models.py, a checkpoint written by transformers (4 layers, width
256, 4 heads of 64, 2 key/value heads, vocabulary 4096) trained at (1,1,1) for --steps steps of 8
rows of 128 tokens, fp32, one thread:

- step time: the engine (run_worker in one gloo process, the function Ray Train calls) against a
  plain loop over transformers' own model on the same rows (SDPA attention, cross-entropy,
  clipping, AdamW; the attention implementation the engine picks for the family), the median of the
  steps after the first two, back to back in one run; with --rounds N, the pair N times in turns
  (the plain loop first in every other round)
  and the median of the N ratios (the step times of the round nearest it);
- memory: the engine's parameter, gradient and optimizer bytes on its rank against the planner's
  prediction for that layout (planner.cost.predict); and the rank's peak memory, its peak RSS above
  the RSS it had before the model was built (interpreter, imports, process group), against the
  planner's whole prediction for the rank (state and activations). RSS counts what the allocator
  keeps and the framework's buffers, so on a CPU it bounds the peak from above.

Writes benchmarks/results/models.json with the command, the machine and the date. With --memory
only the engine runs and only memory is measured, which a busy machine does not change (the step
times need a quiet one): benchmarks/results/models_memory.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "benchmarks" / "results" / "models.json"
OUT_MEMORY = OUT.with_name("models_memory.json")
ROWS, SEQ, WIDTH = 8, 128, 256


def make_checkpoint(root: Path, model_type: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=4096,
        hidden_size=WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=WIDTH // 4,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    out = root / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def plain_loop(path: Path, steps: int) -> list[float]:
    """transformers' own model, the same rows, a plain training step (SDPA, one thread)."""
    import torch
    import torch.nn.functional as F
    from reference import corpus_tokens
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    from raytrain_hybrid.models.generic import attention_implementation

    # The attention the engine runs for the family (SDPA, or eager where the family has no SDPA path).
    attn = attention_implementation(json.loads((path / "config.json").read_text())["model_type"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.from_numpy(corpus_tokens()[: ROWS * (SEQ + 1)].copy()).view(ROWS, SEQ + 1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def engine(path: Path, steps: int) -> dict:
    from gloo_harness import run_gloo_jobs

    overrides = [
        f"model.pretrained={path}",
        "data.path=memory",
        f"model.seq_len={SEQ}",
        f"train.steps={steps}",
        f"train.global_batch_size={ROWS}",
        "train.lr=1e-4",
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.microbatches=1",
    ]
    # (without the test harness's probe, which gathers the weights and takes every parameter's
    # gradient norm each step: the engine's own step, as a user runs it)
    return {"overrides": overrides, **run_gloo_jobs(1, {"run": {"overrides": overrides, "probe": False}})["run"]}


def predicted_bytes(overrides: list[str]) -> tuple[float, float]:
    """The planner's (state, whole rank) bytes for the layout."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import load_hardware

    cfg = load_config(None, overrides)
    mem = predict(cfg, load_hardware("h100"))["memory_bytes"]
    return sum(v for k, v in mem.items() if k not in ("activations", "total")), mem["total"]


def times(run: dict, plain: list[float]) -> dict:
    """Median step times after the first two, the engine's and the plain loop's."""
    eng = statistics.median([h["step_time_s"] for h in run["history"]][2:])
    base = statistics.median(plain[2:])
    return {"engine_step_s": round(eng, 4), "plain_step_s": round(base, 4), "engine_over_plain": round(eng / base, 3)}


def main() -> None:
    from test_models import FAMILIES

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default="")
    ap.add_argument("--memory", action="store_true", help="memory only, into models_memory.json")
    ap.add_argument(
        "--rounds", type=int, default=1, help="engine and plain loop alternated this many times; the median ratio"
    )
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(FAMILIES)
    tmp = Path(tempfile.mkdtemp(prefix="bench-models-"))
    rows = {}
    for mt in names:
        path = make_checkpoint(tmp, mt)
        run = engine(path, args.steps)
        mem = run["memory"][0]
        state = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        predicted, predicted_peak = predicted_bytes(run["overrides"])
        peak = mem["max_rss_bytes"] - mem["rss_before_model_bytes"]
        rows[mt] = {} if args.memory else times(run, plain_loop(path, args.steps))
        if args.rounds > 1 and not args.memory:
            # A shared machine moves a single pair's ratio by several percent: the pair again, in turns,
            # the plain loop first in every other round (whichever runs second finds the caches warm).
            rounds = [rows[mt]]
            for r in range(1, args.rounds):
                plain = plain_loop(path, args.steps) if r % 2 else None
                run = engine(path, args.steps)
                rounds.append(times(run, plain or plain_loop(path, args.steps)))
            ratios = [r["engine_over_plain"] for r in rounds]
            rows[mt] = dict(min(rounds, key=lambda r: abs(r["engine_over_plain"] - statistics.median(ratios))))
            rows[mt] |= {"engine_over_plain": round(statistics.median(ratios), 3), "round_ratios": ratios}
        rows[mt] |= {
            "state_bytes": state,
            "predicted_state_bytes": int(predicted),
            "state_over_predicted": round(state / predicted, 3),
            "max_rss_bytes": mem["max_rss_bytes"],
            "peak_bytes": peak,
            "predicted_peak_bytes": int(predicted_peak),
            "peak_over_predicted": round(peak / predicted_peak, 3),
        }
        print(mt, rows[mt], flush=True)
    record = {
        "command": "benchmarks/bench_models.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only (shared; timings are noisy)",
        "date": datetime.date.today().isoformat(),
        "shape": {"layers": 4, "hidden": WIDTH, "rows": ROWS, "seq": SEQ, "vocab": 4096, "dtype": "float32"},
        "families": rows,
    }
    (OUT_MEMORY if args.memory else OUT).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
