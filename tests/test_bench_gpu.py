"""benchmarks/bench_gpu.py cannot run here (no GPU); its --smoke mode runs the same cases (the
engine's worker loop eager, compiled, compiled with selective checkpointing; the plain loop eager
and compiled) on the CPU with a tiny model, so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from gloo_harness import launch_ranks

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _smoke(rank: int, world: int, out: str) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    import bench_gpu

    # One forked gloo rank (torch and the engine already imported), what main() runs per GPU.
    return bench_gpu.run_rank(rank, world, bench_gpu.parse_args(["--smoke", "--out", out]))


def test_gpu_benchmark_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    launch_ranks(_smoke, 1, str(out))
    result = json.loads(out.read_text())
    assert result["smoke"] and result["torch"] and result["device"]
    row = result["shapes"]["smoke"]
    for case in ("engine_eager", "engine_compiled", "engine_compiled_selective_ac", "plain_eager", "plain_compiled"):
        assert row[case]["step_s"] > 0 and row[case]["tokens_per_s"] > 0, case
    assert row["engine_compiled"]["recompiles_after_first_step"] == 0
    assert row["engine_compiled"]["compile_s"] > 0
    assert {"engine_eager_over_plain_eager_step", "selective_ac_over_no_ac_step"} <= set(row["ratios"])
    # train.fp8, emulated here (torchao's casts, float32 matmuls): the cases a GPU of capability >= 8.9 runs.
    assert row["engine_compiled_fp8"]["step_s"] > 0 and row["engine_compiled_fp8_tensorwise"]["step_s"] > 0
    assert row["ratios"]["engine_compiled_fp8_final_loss_rel_diff"] < 2e-2, row["ratios"]
    # And eager, against bf16 eager (gpu_suite.sh's "bf16 and fp8, eager and compiled").
    assert row["engine_eager_fp8"]["step_s"] > 0 and row["engine_eager_fp8"]["compile_s"] is None
    assert row["ratios"]["engine_eager_fp8_final_loss_rel_diff"] < 2e-2, row["ratios"]
    assert row["ratios"]["engine_eager_fp8_over_engine_eager_step"] > 0


def _fp8_loss(rank: int, world: int, out: str) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    import bench_gpu

    return bench_gpu.run_rank(rank, world, bench_gpu.parse_args(["--smoke", "--fp8-loss-steps", "12", "--out", out]))


def test_fp8_loss_check_trains_both_curves_from_one_seed(tmp_path):
    """--fp8-loss-steps: bf16 and FP8 rowwise (emulated here), compiled, the same steps on the
    shipped corpus; both curves recorded, their last losses compared against the 1 % goal."""
    out = tmp_path / "fp8_loss.json"
    launch_ranks(_fp8_loss, 1, str(out))
    got = json.loads(out.read_text())["fp8_loss"]
    assert got["steps"] == 12 and got["goal_rel_diff"] == 0.01
    bf16, fp8 = got["bf16"], got["fp8_rowwise"]
    assert bf16["losses_every_10"][0] > bf16["losses_every_10"][-1]  # it learns
    # The same start, then FP8's rounding: the curves differ, a little.
    assert abs(fp8["losses_every_10"][0] / bf16["losses_every_10"][0] - 1) < 1e-3
    assert fp8["losses_every_10"] != bf16["losses_every_10"]
    assert got["last_mean_rel_diff"] == abs(fp8["last_mean"] / bf16["last_mean"] - 1) < 0.01 and got["ok"]


def _smoke_with(rank: int, world: int, out: str, extra: list[str]) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    import bench_gpu

    return bench_gpu.run_rank(rank, world, bench_gpu.parse_args(["--smoke", *extra, "--out", out]))


def test_a_subset_of_engine_cases_runs_beside_the_plain_loop_or_without_it(tmp_path):
    """--variants: only the named engine cases, the plain loop still beside them (its ratios those
    the cases allow); --no-plain leaves the plain loop out."""
    out = tmp_path / "gpu.json"
    launch_ranks(_smoke_with, 1, str(out), ["--variants", "engine_compiled_fp8"])
    row = json.loads(out.read_text())["shapes"]["smoke"]
    assert {"engine_compiled_fp8", "plain_eager", "plain_compiled"} <= set(row) and "engine_compiled" not in row
    assert row["ratios"] == {
        "plain_compiled_over_plain_eager_step": pytest.approx(
            row["plain_compiled"]["step_s"] / row["plain_eager"]["step_s"]
        )
    }
    launch_ranks(_smoke_with, 1, str(out), ["--variants", "engine_eager,engine_eager_fp8", "--no-plain"])
    row = json.loads(out.read_text())["shapes"]["smoke"]
    assert set(row) == {"model", "seq_len", "engine_eager", "engine_eager_fp8", "ratios"}
    assert set(row["ratios"]) == {"engine_eager_fp8_over_engine_eager_step", "engine_eager_fp8_final_loss_rel_diff"}


def test_bench_variants_are_checked_by_name():
    sys.path.insert(0, str(BENCHMARKS))
    import bench_gpu

    assert bench_gpu.parse_args(["--variants", "engine_compiled,engine_compiled_fp8"]).variants == [
        "engine_compiled",
        "engine_compiled_fp8",
    ]
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--variants", "engine_compiled_fp9"])
