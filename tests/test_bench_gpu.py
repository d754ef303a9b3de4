"""benchmarks/bench_gpu.py cannot run here (no GPU); its --smoke mode runs the same cases (the
engine's worker loop eager, compiled, compiled with selective checkpointing; the plain loop eager
and compiled) on the CPU with a tiny model, so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
