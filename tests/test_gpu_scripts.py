"""The GPU checks in benchmarks/ (gpu_oracle.py, gpu_grouped_mm.py, gpu_profile.py, and
gpu_suite.sh, which runs them with bench_gpu.py) run on the CPU here, so they cannot rot between GPU runs; their
committed results come from a GPU."""

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


def test_gpu_oracle_builds_an_fp8_case_on_the_cpu_for_its_weight_check():
    """An FP8 case's CPU build (the check that the GPU's initial weights are the CPU's) runs with
    the casts emulated, not refused for want of a float8 GPU, and gives the bf16 case's weights."""
    import numpy as np

    sys.path.insert(0, str(BENCHMARKS))
    import gpu_oracle

    fp8 = gpu_oracle.cpu_initial(gpu_oracle.CASES["llama-fp8-rowwise-compiled"][0])
    bf16 = gpu_oracle.cpu_initial(gpu_oracle.CASES["llama-bf16"][0])
    assert sorted(fp8) == sorted(bf16) and all(np.array_equal(fp8[n], bf16[n]) for n in bf16)


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


def _profile(rank: int, world: int, out: str) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_profile

    return gpu_profile.run(torch.device("cpu"), out)


def test_gpu_profile_smoke_reads_the_traced_steps(tmp_path):
    """gpu_profile.py's CPU mode: run.profile_steps through the worker loop, the trace read by
    trace_ops.py: the two traced steps, and where their time went (matmuls first on a CPU)."""
    row = launch_ranks(_profile, 1, str(tmp_path))
    assert row["ok"] and row["files"] == ["trace_rank0.json"], row
    trace = row["trace"]
    assert trace["steps"] == [4, 5] and len(trace["step_ms"]) == 2 and all(ms > 0 for ms in trace["step_ms"])
    ops = {op["name"]: op for op in trace["top_cpu_ops"]}
    assert "aten::mm" in ops and all(op["self_ms"] > 0 for op in ops.values()), ops
    assert trace["top_cpu_ops"] == sorted(trace["top_cpu_ops"], key=lambda op: -op["self_ms"])
    assert trace["top_gpu_kernels"] == [] and trace["gpu_busy_ms"] == 0


def test_trace_self_time_subtracts_the_ops_an_op_calls(tmp_path, capsys):
    sys.path.insert(0, str(BENCHMARKS))
    import trace_ops

    # linear (10 us) calls mm (6 us), which calls nothing; then an add (2 us); on another thread a backward op.
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "step 3", "ts": 0, "dur": 20, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 1, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2, "dur": 6, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 12, "dur": 2, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 4, "pid": 1, "tid": 2},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 3, "dur": 5, "pid": 0, "tid": 7},
    ]
    path = tmp_path / "trace_rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = trace_ops.read(path)
    assert got["steps"] == [3] and got["step_ms"] == [0.02]
    self_us = {op["name"]: op["self_ms"] * 1e3 for op in got["top_cpu_ops"]}
    assert self_us == {"aten::mm": 10.0, "aten::linear": 4.0, "aten::add": 2.0}
    assert got["top_cpu_ops"][0]["share_of_steps"] == 0.5
    assert got["top_gpu_kernels"] == [{"name": "gemm", "self_ms": 0.005, "share_of_steps": 0.25}]
    # By kind: linear and mm are matmuls; 8 of the step's 20 us its thread spent in no op.
    kinds = {k["name"]: k["self_ms"] * 1e3 for k in got["cpu_by_kind"]}
    assert kinds == {"matmuls": 14.0, "other aten ops": 2.0, "outside any op, on the step's thread": 8.0}
    trace_ops.main([str(path), "--top", "1"])  # as docs/performance.md shows it
    printed = json.loads(capsys.readouterr().out)
    assert printed["top_cpu_ops"] == got["top_cpu_ops"][:1] and printed["cpu_by_kind"] == got["cpu_by_kind"][:1]


def test_gpu_suite_runs_its_four_parts_with_arguments_the_scripts_take():
    """benchmarks/gpu_suite.sh --dry-run: the oracle with every case (FP8 too where torchao is
    here), bench_gpu.py, FP8's 200-step loss check and the profiler smoke, each within its time
    limit, 9 minutes in all (what one lent GPU's call holds beside the machine's start); each
    command line parses with the script's own parser."""
    import subprocess

    sys.path.insert(0, str(BENCHMARKS))
    import bench_gpu
    import gpu_oracle

    done = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_suite.sh"), "--dry-run"],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.strip().splitlines())
    limits = {name.split()[0]: int(name.split("limit ")[1].rstrip("s)")) for name in lines}
    assert list(limits) == ["oracle", "bench", "fp8_loss", "profile"] and sum(limits.values()) <= 9 * 60, limits
    argv = {name.split()[0]: cmd.split()[2:] for name, cmd in lines.items()}
    assert [cmd.split()[1] for cmd in lines.values()] == [
        "benchmarks/gpu_oracle.py",
        "benchmarks/bench_gpu.py",
        "benchmarks/bench_gpu.py",
        "benchmarks/gpu_profile.py",
    ]
    cases = argv["oracle"][argv["oracle"].index("--cases") + 1].split(",")
    assert cases == list(gpu_oracle.CASES) and any("fp8" in c for c in cases)
    bench = bench_gpu.parse_args(argv["bench"])
    assert bench.shapes == ["0.77b", "8b-layers"] and bench.out.endswith("benchmarks/results/gpu.json")
    # bf16 eager and compiled, FP8 compiled both ways, and the plain loop beside them.
    assert bench.variants == [
        "engine_eager",
        "engine_compiled",
        "engine_compiled_fp8",
        "engine_compiled_fp8_tensorwise",
    ]
    assert not bench.no_plain and bench.fp8_loss_steps == 0
    assert "engine_compiled_fp8" in bench_gpu.FP8_VARIANTS and "engine_eager_fp8" in bench_gpu.FP8_VARIANTS
    loss = bench_gpu.parse_args(argv["fp8_loss"])
    assert loss.fp8_loss_steps == 200 and loss.out.endswith("benchmarks/results/gpu_fp8_loss.json")
    assert argv["profile"] == ["--out", "benchmarks/results/gpu_profile.json"]
