"""The GPU checks in benchmarks/ (gpu_oracle.py, gpu_grouped_mm.py) run on the CPU here, so
they cannot rot between GPU runs; their committed results come from a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from gloo_harness import launch_ranks

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _oracle(rank: int, world: int, out: str) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_oracle

    return gpu_oracle.run_cases(["llama-fp32"], torch.device("cpu"), out)


def test_gpu_oracle_script_compares_against_the_reference(tmp_path):
    out = tmp_path / "oracle.json"
    rows = launch_ranks(_oracle, 1, str(out))
    row = rows["llama-fp32"]
    assert row["ok"] and row["n_mismatches"] == 0, row
    assert row["initial_equals_cpu_build"] and row["steps"] == 5
    assert 0 < row["max_rel_param_grad_norm"] < 1e-4
    assert json.loads(out.read_text())["cases"]["llama-fp32"]["ok"]


def test_gpu_oracle_notices_a_wrong_run():
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_oracle

    reference = [{"step": 0, "loss": 2.0, "grad_norm": 1.0, "lr": 0.1, "grad_norms": {"w": 1.0}, "initial": {}}]
    reference[-1]["params"] = {"w": torch.ones(3)}
    run = {
        "history": [{"step": 0, "loss": 2.1, "grad_norm": 1.0, "lr": 0.1}],
        "probe": {"initial": {}, "grad_norms": [{"w": 1.0}], "final": {"w": torch.ones(3).numpy()}},
    }
    row = gpu_oracle.compare(run, reference, loss_only=False)
    assert not row["ok"] and any("loss at step 0" in m for m in row["mismatches"])
    assert gpu_oracle.compare(run, reference, loss_only=True)["ok"] is False  # 5 % > the bf16 bound


def test_grouped_expert_compute_equals_the_loop():
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_grouped_mm

    real = torch._grouped_mm
    torch._grouped_mm = gpu_grouped_mm._counting(real)
    try:
        row = gpu_grouped_mm.agreement(torch.device("cpu"))
    finally:
        torch._grouped_mm = real
    assert row["grouped_mm_calls_forward"] == 2  # the grouped path ran
    for name, err in row["grouped_rel_err_vs_fp32_loop"].items():
        assert err < 2 * row["bf16_loop_rel_err_vs_fp32_loop"][name] + 1e-3, name
