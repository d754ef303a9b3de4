"""Published large training runs, as the planner's check against reality.

Each entry is a real run at a real layout, with its source. ``assess`` pins the
published fields (dp, tp, pp and whatever else the source states) and lets the
planner search the rest (micro-batch count, ZeRO stage, recomputation, SP), then
reports the best feasible row next to the published figure.

MFU here is model FLOPs (6N + attention per token, no recomputation) over the peak
the source uses. Narayanan et al. report hardware FLOPs including the recomputed
forward; their 52 % is 52 % x 3/4 = 39 % in model FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_hybrid.config import LAYOUT_KEYS, Config, parse_overrides, resolve_defaults
from raytrain_hybrid.planner.hardware import PROFILES
from raytrain_hybrid.planner.search import plan

GPT3_175B = {
    "model.arch": "gpt2",
    "model.num_layers": 96,
    "model.hidden_size": 12288,
    "model.num_heads": 96,
    "model.ffn_hidden_size": 49152,
    "model.vocab_size": 51200,  # GPT-2's 50257 padded to a multiple of 1024, as Megatron does
    "model.seq_len": 2048,
}
LLAMA3_8B = {
    "model.num_layers": 32,
    "model.hidden_size": 4096,
    "model.num_heads": 32,
    "model.num_kv_heads": 8,
    "model.ffn_hidden_size": 14336,
    "model.vocab_size": 128256,
    "model.seq_len": 8192,
}
LLAMA3_70B = {**LLAMA3_8B, "model.num_layers": 80, "model.hidden_size": 8192, "model.num_heads": 64}
LLAMA3_70B["model.ffn_hidden_size"] = 28672
LLAMA3_405B = {**LLAMA3_8B, "model.num_layers": 126, "model.hidden_size": 16384, "model.num_heads": 128}
LLAMA3_405B["model.ffn_hidden_size"] = 53248


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    name: str
    source: str
    model: dict
    hardware: str  # a planner profile
    world: int
    global_batch: int  # sequences
    layout: dict  # what the source states: dp, tp, pp, and any of schedule, zero, ac
    mfu: tuple[float, float] | None = None  # published model-FLOPs MFU (low, high)
    tokens_per_s_per_gpu: float | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)


RUNS = [
    PublishedRun(
        name="GPT-3 175B, 1024 A100 (Megatron-LM)",
        source="Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
        "Megatron-LM, SC'21, table 1 (175B row: TP 8, PP 8, 1024 GPUs, batch 1536, 163 TFLOP/s = 52 % of "
        "peak in hardware FLOPs with full recomputation)",
        model=GPT3_175B,
        hardware="a100-80",
        world=1024,
        global_batch=1536,
        layout={"dp": 16, "tp": 8, "pp": 8, "activation_checkpointing": True, "sequence_parallel": False},
        mfu=(0.39, 0.39),
    ),
    PublishedRun(
        name="Llama 3 405B, 8192 H100 (Meta)",
        source="Llama Team, The Llama 3 Herd of Models, 2024, table 4 (TP 8, CP 1, PP 16, DP 64, seq 8192, "
        "batch/DP 32, 430 TFLOP/s per GPU, 43 % BF16 MFU)",
        model=LLAMA3_405B,
        hardware="h100",
        world=8192,
        global_batch=2048,
        layout={"dp": 64, "tp": 8, "pp": 16},
        mfu=(0.43, 0.43),
    ),
    PublishedRun(
        name="Llama 3.1 405B, 512 H100 (torchtitan 3D)",
        source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 5 (FSDP 8, TP 8, PP 8, "
        "local batch 32, global batch 256, full AC, Interleaved 1F1B 128 tokens/s/GPU with Float8; no MFU "
        "published)",
        model=LLAMA3_405B,
        hardware="h100-96",
        world=512,
        global_batch=256,
        layout={"dp": 8, "tp": 8, "pp": 8, "zero": 3, "activation_checkpointing": True, "schedule": "Interleaved1F1B"},
        tokens_per_s_per_gpu=128.0,
    ),
    PublishedRun(
        name="Llama 3.1 70B, 256 H100 (torchtitan 2D)",
        source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 4 (FSDP 32, TP 8, local "
        "batch 16, global batch 512, full AC, 829 tokens/s/GPU with Float8; no MFU published)",
        model=LLAMA3_70B,
        hardware="h100-96",
        world=256,
        global_batch=512,
        layout={"dp": 32, "tp": 8, "pp": 1, "zero": 3, "activation_checkpointing": True},
        tokens_per_s_per_gpu=829.0,
    ),
    PublishedRun(
        name="Llama 3.1 8B, 128 H100 (torchtitan FSDP)",
        source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 3 and text (FSDP 128, "
        "local batch 2, global batch 256, selective AC, 5,605 tokens/s/GPU; 33-39 % MFU without Float8)",
        model=LLAMA3_8B,
        hardware="h100-96",
        world=128,
        global_batch=256,
        layout={"dp": 128, "tp": 1, "pp": 1, "zero": 3, "activation_checkpointing": False},
        mfu=(0.33, 0.39),
        tokens_per_s_per_gpu=5605.0,
    ),
]


def config_of(run: PublishedRun) -> Config:
    """Model and batch of the run; the layout is the planner's to fill (each candidate is validated)."""
    overrides = [f"{k}={v}" for k, v in run.model.items()]
    overrides += [f"train.global_batch_size={run.global_batch}", "train.dtype=bfloat16", "cluster.use_gpu=true"]
    return resolve_defaults(Config.from_dict(parse_overrides(overrides)))


def assess(run: PublishedRun) -> dict:
    """The planner's best row at the published layout, and how it compares."""
    hw = PROFILES[run.hardware]
    rows = plan(config_of(run), run.world, hw, fixed=run.layout)
    best = rows[0] if rows else None
    out = {
        "name": run.name,
        "source": run.source,
        "hardware": hw.name,
        "world": run.world,
        "layout": run.layout,
        "rows": len(rows),
        "feasible": bool(best and best["feasible"]),
        "published_mfu": run.mfu,
        "published_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
    }
    if best:
        out["best"] = {k: v for k, v in best.items() if k in LAYOUT_KEYS} | {
            "gib_per_rank": best["memory_bytes"]["total"] / 1024**3,
            "reason": best["reason"],
        }
        out["predicted_mfu"] = best["predicted_mfu"]
        out["predicted_tokens_per_s_per_gpu"] = best["predicted_tokens_per_s"] / run.world
        if run.mfu:
            out["mfu_ratio"] = (best["predicted_mfu"] / run.mfu[1], best["predicted_mfu"] / run.mfu[0])
    return out
