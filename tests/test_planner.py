"""Cost model: hand-computed memory cases, and published training configurations.

Published layouts (cited): GPT-3 175B trained with Megatron-LM at TP=8, PP=8 (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21; the
512-GPU 8x8x8 reading of shared/seeds/004); Llama 3 405B at TP=8, PP=16, DP=128 on 16K H100
(Dubey et al., "The Llama 3 Herd of Models", 2024, table 4).
"""

from __future__ import annotations

import json
import re

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.planner import PROFILES, param_count, plan, predict, state_bytes

PHI = 1e9


@pytest.mark.parametrize(
    ("zero", "expected"),
    [(0, 16 * PHI), (1, 4 * PHI + 12 * PHI / 8), (2, 2 * PHI + 14 * PHI / 8), (3, 16 * PHI / 8)],
)
def test_zero_paper_mixed_precision_adam(zero, expected):
    got = state_bytes(PHI, zero=zero, dp=8, scheme="mixed")
    assert sum(got.values()) == pytest.approx(expected)


def test_fp32_master_scheme_is_what_the_engine_keeps():
    assert state_bytes(PHI, zero=1, dp=4) == {"params": 4 * PHI, "grads": 4 * PHI, "optimizer": 2 * PHI}


def test_memory_prediction_matches_a_hand_count():
    cfg = load_config(None, ["parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=2", "parallelism.zero=3"])
    pred = predict(cfg, PROFILES["h100"])
    m = cfg.model
    kv = m.num_kv_heads * m.hidden_size // m.num_heads
    per_layer = (
        2 * m.hidden_size**2 + 2 * m.hidden_size * kv + 3 * m.hidden_size * m.ffn_hidden_size + 2 * m.hidden_size
    )
    last_stage = 2 * per_layer + m.hidden_size + m.vocab_size * m.hidden_size  # 2 blocks, final norm, head
    assert param_count(m) == 4 * per_layer + 2 * m.vocab_size * m.hidden_size + m.hidden_size
    phi = last_stage / 2  # the fuller pipeline rank, split over tp=2
    assert pred["memory_bytes"]["params"] == pytest.approx(4 * phi / 2)
    assert pred["memory_bytes"]["optimizer"] == pytest.approx(8 * phi / 2)
    assert pred["bubble_fraction"] == pytest.approx(1 / 5)  # (pp-1)/(m+pp-1) with m=4


def _published(arch_overrides, world, gbs):
    return load_config(None, [*arch_overrides, f"train.global_batch_size={gbs}", "train.dtype=bfloat16"])


GPT3 = [
    "model.num_layers=96",
    "model.hidden_size=12288",
    "model.num_heads=96",
    "model.vocab_size=51200",
    "model.seq_len=2048",
    "model.ffn_hidden_size=49152",
]
LLAMA3_405B = [
    "model.num_layers=126",
    "model.hidden_size=16384",
    "model.num_heads=128",
    "model.num_kv_heads=8",
    "model.ffn_hidden_size=53248",
    "model.vocab_size=128256",
    "model.seq_len=8192",
]
LLAMA2_70B = [
    "model.num_layers=80",
    "model.hidden_size=8192",
    "model.num_heads=64",
    "model.num_kv_heads=8",
    "model.ffn_hidden_size=28672",
    "model.vocab_size=32000",
    "model.seq_len=4096",
]


def test_gpt3_8x8x8_is_feasible_on_h100():
    rows = plan(_published(["model.arch=gpt2", *GPT3], 512, 1536), 512, PROFILES["h100"])
    used = [r for r in rows if (r["dp"], r["tp"], r["pp"]) == (8, 8, 8)]
    assert used and any(r["feasible"] for r in used)


def test_llama3_405b_layout_is_feasible_on_h100():
    cfg = _published(LLAMA3_405B, 16384, 2048)
    import dataclasses

    par = dataclasses.replace(
        cfg.parallelism, dp=128, tp=8, pp=16, microbatches=16, zero=1, activation_checkpointing=True, schedule="1F1B"
    )
    pred = predict(dataclasses.replace(cfg, parallelism=par), PROFILES["h100"])
    assert pred["memory_bytes"]["total"] < PROFILES["h100"].memory_bytes


def test_pure_data_parallel_70b_is_infeasible_with_the_reason():
    rows = plan(_published(LLAMA2_70B, 64, 64), 64, PROFILES["a100-80"])
    pure_dp = [r for r in rows if (r["tp"], r["pp"], r["zero"]) == (1, 1, 0)]  # plain replication
    assert pure_dp and not any(r["feasible"] for r in pure_dp)
    # 69e9 parameters x 16 bytes of weights, gradients and Adam state on every rank: >= 1028 GiB
    for r in pure_dp:
        match = re.fullmatch(r"needs ([0-9.]+) GiB per rank > 74.5 GiB", r["reason"])
        assert match and float(match.group(1)) >= 16 * 69e9 / 2**30, r["reason"]
    assert rows[0]["feasible"] and rows[-1]["feasible"] is False  # feasible first, infeasible last


def test_plan_cli_json():
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["plan", "--world-size", "8", "--gpus-per-node", "8", "--json", "--top", "5"]) == 0
    rows = json.loads(buf.getvalue())
    assert len(rows) == 5
    for key in (
        "dp",
        "tp",
        "pp",
        "microbatches",
        "schedule",
        "zero",
        "activation_checkpointing",
        "feasible",
        "reason",
        "memory_bytes",
        "predicted_step_s",
        "predicted_tokens_per_s",
        "predicted_mfu",
        "bubble_fraction",
    ):
        assert key in rows[0]
    assert set(rows[0]["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "total"}
    tps = [r["predicted_tokens_per_s"] for r in rows]
    assert tps == sorted(tps, reverse=True)
