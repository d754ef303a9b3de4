"""Speed features against the oracle (issue 21): selective activation checkpointing and
per-block torch.compile (inductor's C++ backend on CPU, fp32) train exactly the model the
single-process reference trains, at the tolerances of tests/test_oracle.py.

Compiling is the cost here (a cold inductor compile of one block's forward and backward is
~25 s of CPU on this machine): the compiled runs share one inductor cache directory, and the
multi-rank run is laid out so that its blocks see the shapes the (1,1,1) run compiled
(4 rows a micro-batch), so its ranks load that run's kernels instead of compiling their own.
The TP twins ((2,2,2) 1F1B ZeRO-1, (1,2,4) with SP: DTensor blocks, another graph that every rank
compiles cold at once) take minutes here; they run with RAYTRAIN_COMPILE_TWINS=1.
"""

from __future__ import annotations

import os

import pytest
from conftest import reference_history
from gloo_harness import run_gloo
from test_oracle import MEMORY, SHORT, assert_oracle, layout

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

SELECTIVE = "parallelism.activation_checkpointing=selective"


@pytest.mark.parametrize(
    "name, where",
    [("1x1x1", layout(1, 1, 1, microbatches=1)), ("2x2x2-1f1b", layout(2, 2, 2, "1F1B", 2))],
)
def test_selective_checkpointing_matches_single_process(name, where):
    result = run_gloo([*SHORT, *MEMORY, *where, SELECTIVE])
    assert_oracle(result, reference_history(SHORT + MEMORY, "memory"))
    assert "compiles" not in result["history"][0]  # parallelism.compile=auto: off on CPU


def test_activation_checkpointing_values():
    """true (full) and false (none) keep their meaning; a wrong value is refused naming the key
    and every allowed value; compile takes true, false or auto."""
    assert load_config(None, [SELECTIVE]).parallelism.activation_checkpointing == "selective"
    assert load_config(None, ["parallelism.activation_checkpointing=true"]).parallelism.activation_checkpointing is True
    assert load_config(None, []).parallelism.activation_checkpointing is False
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["parallelism.activation_checkpointing=partial"])
    assert bad.value.key == "parallelism.activation_checkpointing"
    assert all(v in str(bad.value) for v in ("false", "true", "selective")), str(bad.value)
    assert load_config(None, []).parallelism.compile is None  # auto: on with GPUs, off on CPU
    assert load_config(None, ["parallelism.compile=auto"]).parallelism.compile is None
    assert load_config(None, ["parallelism.compile=true"]).parallelism.compile is True
    with pytest.raises(ConfigError, match=r"parallelism\.compile.*auto"):
        load_config(None, ["parallelism.compile=sometimes"])


@pytest.fixture(scope="module")
def inductor_env(tmp_path_factory):
    """One cold inductor cache for this module's compiled runs (not the machine's warm one, so
    the suite's time does not depend on what ran before), compiled in each rank's own process."""
    cache = tmp_path_factory.mktemp("inductor")
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}


COMPILED = {
    # (1,1,1) with gradient accumulation: 4 rows a micro-batch, the shapes the next one reuses.
    "1x1x1-m4": layout(1, 1, 1, microbatches=4),
    "2x1x2-zero1-1f1b": layout(2, 1, 2, "1F1B", 2, 1),
}

# TP with sequence parallelism: both at tp=2 and 4 rows a micro-batch, so the second loads the
# first's kernels.
COMPILED_TP = {
    "2x2x2-zero1-1f1b": layout(2, 2, 2, "1F1B", 2, 1),
    "1x2x4-sp": layout(1, 2, 4, "1F1B", 4),
}
TWINS = [pytest.mark.slow, pytest.mark.skipif(not os.environ.get("RAYTRAIN_COMPILE_TWINS"), reason="minutes")]


@pytest.mark.parametrize("name", [*COMPILED, *(pytest.param(n, marks=TWINS) for n in COMPILED_TP)])
def test_compiled_blocks_match_single_process(name, inductor_env):
    """Every block compiled: the oracle holds, the first step compiles, no later step does
    (a recompilation per step would cost its seconds at every step), and the start-up
    breakdown has the compile's share of the first step."""
    where = {**COMPILED, **COMPILED_TP}[name]
    result = run_gloo([*SHORT, *MEMORY, *where, "parallelism.compile=true"], env=inductor_env)
    assert_oracle(result, reference_history(SHORT + MEMORY, "memory"))
    history = result["history"]
    assert history[0]["compiles"] > 0 and history[0]["compile_s"] > 0, history[0]
    assert [h["compiles"] for h in history[1:]] == [0] * (len(history) - 1), history
    assert result["marks"]["first_step_compile_s"] == history[0]["compile_s"]


def test_startup_breakdown_names_the_compile():
    """summary.json's startup_s: the compile's seconds stand beside first_step, which holds them."""
    from raytrain_hybrid.launch.records.summary import startup_breakdown

    marks = {"launched": 0.0, "first_batch": 1.0, "first_step_done": 5.0, "first_step_compile_s": 3.25}
    out = startup_breakdown(marks)
    assert out["first_step"] == 4.0 and out["first_step_compile"] == 3.25


def test_startup_cpu_counts_each_phase_from_the_mark_before():
    """summary.json's startup_cpu_s: rank 0's worker CPU before the train function, then per
    phase (a phase whose mark is missing, no checkpoint here, is left out), and the total."""
    from raytrain_hybrid.launch.records.summary import startup_cpu

    marks = {"worker_entered": 10.0, "cpu_worker_entered": 3.5, "cpu_worker_imported": 5.0,
             "cpu_group_ready": 5.25, "cpu_mesh_built": 5.5, "cpu_model_built": 6.0, "cpu_first_batch": 6.25,
             "cpu_first_step_done": 7.5}  # fmt: skip
    assert startup_cpu(marks) == {
        "ray_worker": 3.5, "worker_imports": 1.5, "process_group": 0.25, "mesh": 0.25, "model_build": 0.5,
        "first_batch": 0.25, "first_step": 1.25, "total_to_first_step": 7.5,
    }  # fmt: skip
    assert startup_cpu({"launched": 0.0}) == {}  # a run without workers' marks (it failed before)
