"""Engine layer without Ray: several gloo processes run worker.run_worker directly.

Covers the schedules and DP modes test_oracle.py does not, against the same
single-process reference and with the same per-parameter oracle. DualPipeV also saves and
resumes at another layout (its V stages resharded into 1F1B's looped ones).
"""

from __future__ import annotations

import pytest
from conftest import reference_history
from gloo_harness import run_gloo
from test_oracle import assert_oracle

from raytrain_hybrid.checkpoint.manifest import read_manifest

STEPS = 3
COMMON = (f"train.steps={STEPS}", "model.num_layers=4", "train.global_batch_size=16", "model.seq_len=32")


CASES = {
    "interleaved1f1b-1x2x2": [
        "parallelism.dp=1",
        "parallelism.tp=2",
        "parallelism.pp=2",
        "parallelism.schedule=Interleaved1F1B",
        "parallelism.microbatches=2",
    ],
    "zbv-zero1-2x1x2": [
        "parallelism.dp=2",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.schedule=ZBVZeroBubble",
        "parallelism.microbatches=2",
        "parallelism.zero=1",
    ],
    "loopedbfs-1x1x2": [
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.schedule=LoopedBFS",
        "parallelism.microbatches=2",
    ],
    "interleavedzb-1x1x2": [
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.schedule=InterleavedZeroBubble",
        "parallelism.microbatches=2",
    ],
    "zero2-ac-2x1x2": [
        "parallelism.dp=2",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.zero=2",
        "parallelism.activation_checkpointing=true",
        "parallelism.microbatches=2",
    ],
    "zero3-tp-2x2x1": [
        "parallelism.dp=2",
        "parallelism.tp=2",
        "parallelism.pp=1",
        "parallelism.zero=3",
        "parallelism.microbatches=2",
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_single_process(name):
    assert_oracle(run_gloo([*COMMON, *CASES[name]]), reference_history(COMMON))


# DualPipeV: a V layout (rank 0 holds the first and last of four stages), one micro-batch a
# stage at least (2*pp), ZeRO-1's optimizer slices over the replicas.
DUALPIPEV = (
    "parallelism.dp=2",
    "parallelism.tp=1",
    "parallelism.pp=2",
    "parallelism.schedule=DualPipeV",
    "parallelism.microbatches=4",
    "parallelism.zero=1",
)
LOOPED = ("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2", "parallelism.microbatches=2")


def test_dualpipev_matches_and_resumes_under_another_layout(tmp_path):
    """DualPipeV trains the single-process model (losses, every parameter's gradient norm, final
    weights); its checkpoint after step 1, resumed at (1,1,2) under 1F1B (each rank's stages
    gathered from both saving ranks' V halves, ZeRO-1 slices into plain AdamW), gives the
    uninterrupted run's steps 1 and 2."""
    reference = reference_history(COMMON)
    saved = run_gloo([*COMMON, *DUALPIPEV, "checkpoint.interval=1", f"run.output_dir={tmp_path / 'v'}"])
    assert_oracle(saved, reference)
    step1 = tmp_path / "v" / "checkpoints" / "step_1"
    assert read_manifest(step1)["layout"]["schedule"] == "DualPipeV"
    resumed = run_gloo([*COMMON, *LOOPED, f"run.output_dir={tmp_path / 'looped'}"], resume=str(step1))
    assert_oracle(resumed, reference, first=1)


def test_bfloat16_autocast_tracks_float32():
    """bf16 cannot meet the fp32 tolerance; it must still train the same model closely, and
    the Linear layers must have computed in bfloat16 (autocast on, not silently off)."""
    layout = ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1"]
    result = run_gloo([*COMMON, *layout, "train.dtype=bfloat16"], watch_dtypes=True)
    assert "torch.bfloat16" in result["probe"]["dtypes"], result["probe"]["dtypes"]
    history = result["history"]
    reference = reference_history(COMMON)
    for got, want in zip(history, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
    assert history[-1]["loss"] < history[0]["loss"]


def test_interleaved_node_order_keeps_tp_on_a_node_and_matches():
    """Ranks alternate between two nodes; TP groups must still sit on one node each."""
    layout = ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=2"]
    result = run_gloo([*COMMON, *layout], nodes=2)
    ranks = result["memory"]
    tp_groups: dict[tuple, set] = {}
    pp_groups: dict[tuple, set] = {}
    for r in ranks:
        tp_groups.setdefault((r["pp"], r["dp"]), set()).add(r["node"])
        pp_groups.setdefault((r["dp"], r["tp"]), set()).add(r["node"])
    assert all(len(nodes) == 1 for nodes in tp_groups.values()), ranks
    assert all(len(nodes) == 2 for nodes in pp_groups.values()), ranks
    # the arrangement is not the identity: rank 1 is not rank 0's TP partner
    by_rank = {r["rank"]: r for r in ranks}
    assert (by_rank[0]["pp"], by_rank[0]["dp"]) != (by_rank[1]["pp"], by_rank[1]["dp"])
    assert_oracle(result, reference_history(COMMON))
