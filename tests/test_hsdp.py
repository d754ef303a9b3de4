"""Hybrid sharding (parallelism.replicate): dp = replicate x shard, ZeRO's state sharded inside a
shard group and replicated across the replica groups.

The oracle in one gloo launch of 8 ranks: FSDP2 (zero=3) at replicate 2 x shard 2 under a
pipeline, ZeRO-1 at replicate 2 x shard 2 under tensor parallelism, and both under context
parallelism (shard groups of dp/replicate x cp), each equal to the single-process run (losses,
every parameter's gradient norm, final weights); the first two each save a
checkpoint at step 2, and the run resumes from it under another layout (the first into (2,2,2)
ZeRO-1 without hybrid sharding, the second into zero=2 at replicate 2 x shard 2 under TP, FSDP2
on a (replicate, shard, tp) mesh) with the uninterrupted run's steps 2 to 4.
"""

from __future__ import annotations

import json

import pytest
from conftest import reference_history
from gloo_harness import run_gloo_jobs
from test_oracle import MEMORY, SHORT, assert_oracle, assert_replicas_share_rows

from raytrain_hybrid.checkpoint import manifest as checkpoint
from raytrain_hybrid.config import load_config, validate
from raytrain_hybrid.errors import ConfigError

COMMON = (*SHORT, *MEMORY)  # test_oracle's: 5 steps, its single-process reference


def par(dp, tp, pp, zero, replicate=1):
    keys = {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "replicate": replicate, "microbatches": 2}
    return [f"parallelism.{k}={v}" for k, v in keys.items()]


HSDP = {
    "4x1x2-r2-zero3": par(4, 1, 2, 3, 2),
    "4x2x1-r2-zero1": par(4, 2, 1, 1, 2),
    # Context parallelism: the shard group is dp/replicate x cp (the cp ranks shard like dp ranks).
    "4cp2-r2-zero1": [*par(4, 1, 1, 1, 2), "parallelism.cp=2"],
    "4cp2-r2-zero3": [*par(4, 1, 1, 3, 2), "parallelism.cp=2"],
}
# Resumed into (2,2,2) ZeRO-1 without hybrid sharding, and into FSDP2's hybrid sharding under TP.
RESUME = {"4x1x2-r2-zero3": par(2, 2, 2, 1), "4x2x1-r2-zero1": par(4, 2, 1, 2, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    jobs: dict = {
        name: [
            *COMMON,
            *layout,
            *(["checkpoint.interval=2", f"run.output_dir={root / name}"] if name in RESUME else []),
        ]
        for name, layout in HSDP.items()
    }
    for name, layout in RESUME.items():
        step2 = root / name / "checkpoints" / "step_2"
        jobs[f"resumed-{name}"] = {
            "overrides": [*COMMON, *layout, f"run.output_dir={root / 'r' / name}"],
            "resume": str(step2),
        }
    return root, run_gloo_jobs(8, jobs)


@pytest.mark.parametrize("name", sorted(HSDP))
def test_hybrid_sharding_matches_single_process(runs, name):
    root, results = runs
    assert_oracle(results[name], reference_history(COMMON, "memory"))
    assert_replicas_share_rows(results[name]["memory"], HSDP[name])
    # The state is sharded over a shard group of 2, held twice (once per replica group).
    memory = results[name]["memory"]
    cp = 2 if "cp2" in name else 1
    if "zero3" in name:  # parameters: every element on 2 of the 8 ranks (one per replica group)
        whole = 4 * sum(v.size for v in results[name]["probe"]["initial"].values())
        assert sum(r["param_bytes"] for r in memory) == pytest.approx(2 * whole, rel=0.02)
    else:  # ZeRO-1: AdamW's two fp32 moments of 1/(2 cp) of a rank's parameters (1/(4 cp) without replicate)
        want = [pytest.approx(r["param_bytes"] / cp, rel=0.05) for r in memory]
        assert [r["optimizer_bytes"] for r in memory] == want, memory
    if name in RESUME:
        manifest = checkpoint.verify(root / name / "checkpoints" / "step_2")
        assert manifest["step"] == 2 and manifest["world_size"] == 8


@pytest.mark.parametrize("name", sorted(RESUME))
def test_hybrid_sharded_checkpoint_resumes_under_another_layout(runs, name):
    _, results = runs
    assert_oracle(results[f"resumed-{name}"], reference_history(COMMON, "memory"), first=2)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["parallelism.dp=4", "parallelism.replicate=3", "parallelism.zero=3"], "must divide dp=4; try replicate in"),
        (["parallelism.dp=4", "parallelism.replicate=2"], "zero=0 shards nothing"),
        (["parallelism.replicate=0"], "must be >= 1"),
    ],
)
def test_replicate_is_checked(sets, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, sets))


def test_check_shows_the_shard_and_replica_groups(capsys):
    """Two nodes of 4: the shard groups (dp ranks 0-1 and 2-3 of each tp rank) inside a node, the
    replica groups across the nodes; the start line says so too."""
    from raytrain_hybrid import cli

    sets = par(4, 2, 1, 3, 2)
    assert cli.main(["check", *[a for s in sets for a in ("--set", s)], "--topology", "4,4"]) == 0
    out = capsys.readouterr().out
    assert (
        "hybrid sharding: dp=4 as replicate=2 x shard=2 (zero=3): shard groups [[0, 2], [4, 6], [1, 3], [5, 7]] "
        "inside a node; replica groups [[0, 4], [2, 6], [1, 5], [3, 7]] across nodes (4 of 4)" in out
    ), out
    assert "start: dp=4 zero=3 replicate=2 tp=2 pp=1" in out and "replica groups across nodes (4 of 4)" in out, out
    assert cli.main(["check", *[a for s in sets for a in ("--set", s)], "--topology", "4,4", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert groups["shard"] == [[0, 2], [4, 6], [1, 3], [5, 7]] and groups["replicate"] == [
        [0, 4],
        [2, 6],
        [1, 5],
        [3, 7],
    ]


def test_planner_counts_the_shard_groups_memory_and_the_replicas_all_reduce():
    """An 8B-shaped model on two nodes of 8 H100s, dp=16: hybrid sharding (2 x 8) holds twice
    full sharding's state a rank and adds one all-reduce of a shard's gradients across the nodes,
    but keeps the reduce-scatters inside a node: faster, and what the search puts first."""
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import PROFILES
    from raytrain_hybrid.planner.search import plan

    hw = PROFILES["h100"]
    model = ["model.hidden_size=4096", "model.num_layers=32", "model.num_heads=32", "model.seq_len=4096"]
    base = [
        *model,
        "model.vocab_size=128256",
        "train.global_batch_size=64",
        "parallelism.activation_checkpointing=true",
    ]
    full, hybrid = (predict(load_config(None, [*base, *par(16, 1, 1, 3, r)]), hw) for r in (1, 2))
    for key in ("params", "grads", "optimizer"):
        assert hybrid["memory_bytes"][key] == pytest.approx(2 * full["memory_bytes"][key])
    assert full["time_s"]["dp_replicate"] == 0 < hybrid["time_s"]["dp_replicate"] < hybrid["time_s"]["dp"]
    assert hybrid["time_s"]["dp"] < full["time_s"]["dp"]
    rows = plan(load_config(None, [*base, "parallelism.dp=16"]), 16, hw, fixed={"tp": 1, "pp": 1, "microbatches": 4})
    assert rows[0]["replicate"] == 2 and {r["replicate"] for r in rows} == {1, 2}
