"""Elastic data parallelism (parallelism.min_dp): the dp values a run may take, refused input,
and the engine's side of a resize.

A resize restarts the worker group from the newest checkpoint at another dp; the engine then
runs the same steps with each replica accumulating more (or fewer) micro-batches of the same
rows. Here, as plain gloo processes (no Ray): runs at dp=3 save a checkpoint and are resumed
with the same config on 2 workers (dp=2), plain, under ZeRO-1, at pp=2 and at cp=2 (on 6
and 4 workers); every step of both halves equals the single-process oracle (losses, every
parameter's gradient norm, the final parameters). Through Ray Train, with nodes lost and
added on a simulated cluster: tests/test_topology_ray.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import reference_history
from gloo_harness import run_gloo_jobs
from test_oracle import assert_oracle

from raytrain_hybrid import cli
from raytrain_hybrid.checkpoint.manifest import read_manifest
from raytrain_hybrid.config import load_config
from raytrain_hybrid.config.elastic import at_world, usable_dps
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.plan.elastic import scaling_workers, worker_counts, workers_that_fit
from raytrain_hybrid.planner.hardware import PROFILES

MODEL = ("train.steps=4", "model.num_layers=2", "model.seq_len=32", "train.global_batch_size=12", "data.path=memory")


def elastic(dp=3, pp=1, microbatches=2, min_dp=1, *extra):
    return [
        f"parallelism.dp={dp}",
        f"parallelism.min_dp={min_dp}",
        "parallelism.tp=1",
        f"parallelism.pp={pp}",
        f"parallelism.microbatches={microbatches}",
        *extra,
    ]


# The single-process oracle of every case (it reads the model, batch and steps only).
REFERENCE = (*MODEL, *elastic())


# ------------------------------------------------------------------ config, no process group


def test_dp_values_keep_the_micro_batch():
    """12 rows a step in 3*2 micro-batches of 2 rows: dp 1, 2 or 3 (6, 3, 2 micro-batches a
    replica). At dp=4 with one micro-batch of 4 rows, 3 replicas cannot split 4 micro-batches."""
    cfg = load_config(None, [*MODEL, *elastic()])
    assert usable_dps(cfg.parallelism) == [1, 2, 3]
    two = at_world(cfg, 2).parallelism
    assert (two.dp, two.microbatches, two.min_dp) == (2, 3, 1)
    assert at_world(cfg, 3) is cfg
    four = load_config(None, [*MODEL, "train.global_batch_size=16", *elastic(dp=4, microbatches=1)])
    assert usable_dps(four.parallelism) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"3 workers started .* dp in \{1, 2, 4\}"):
        at_world(four, 3)
    # pp=2 with 1F1B: a replica is 2 workers; 5 workers are no layout.
    pp2 = load_config(None, [*MODEL, *elastic(pp=2)])
    assert worker_counts(pp2) == [2, 4, 6] and scaling_workers(pp2) == {"num_workers": (2, 6)}
    assert at_world(pp2, 4).parallelism.microbatches == 3
    with pytest.raises(ValueError, match="multiple of tp\\*pp=2"):
        at_world(pp2, 5)
    assert scaling_workers(load_config(None, [*MODEL, *elastic(min_dp=0)])) == {"num_workers": 3}


def test_ray_is_asked_only_for_whole_replicas_with_tp_inside_a_node():
    """What the scaling policy hands Ray Train (launch.runtime.elastic_ray): the largest usable count
    the nodes hold with every TP group on one node, else what they hold (below the minimum: Ray
    waits)."""
    gpu = {"CPU": 1, "GPU": 1}
    counts = [2, 4, 8]  # tp=2, pp=1 at dp 1, 2, 4 (3 replicas would not split the batch)
    nodes = [{"CPU": 8, "GPU": 3}, {"CPU": 8, "GPU": 3}]  # 6 GPUs, 4 of them in whole TP pairs
    assert workers_that_fit(nodes, gpu, 2, counts) == 4
    assert workers_that_fit([*nodes, {"CPU": 4, "GPU": 4}], gpu, 2, counts) == 8
    assert workers_that_fit([{"CPU": 8, "GPU": 1}], gpu, 2, counts) == 0
    assert workers_that_fit([{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], gpu, 1, [1, 2, 3]) == 2


def test_a_drained_node_shrinks_the_group_only_at_its_restart(monkeypatch):
    """A node drained for preemption (launch.runtime.elastic_ray): the running group's looks for a
    resize still count it (a shrink then would skip the save at the notice: the group is torn
    down before its ranks hear of it); the restart at the deadline does not wait for it."""
    from types import SimpleNamespace

    from raytrain_hybrid.launch.runtime.session import use_train_v2

    use_train_v2()
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    from raytrain_hybrid.launch.runtime import elastic_ray

    nodes = {name: {"CPU": 1, "GPU": 1} for name in ("a", "b", "c")}
    policy = elastic_ray.ReplicaScalingPolicy(ScalingConfig(num_workers=(1, 3), use_gpu=True), counts=[1, 2, 3], tp=1)
    monkeypatch.setattr(policy, "_get_reserved_resources", lambda: nodes)
    monkeypatch.setattr(policy, "_maybe_send_resource_request", lambda: None)
    running = SimpleNamespace(start_time=float("-inf"), num_workers=3)
    monkeypatch.setattr(elastic_ray, "_draining_nodes", lambda: {"c"})
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)
    assert policy._count_possible_workers(nodes) == 2  # the restart's count
    # A node joining a running group that is below its dp still grows it.
    monkeypatch.setattr(elastic_ray, "_draining_nodes", set)
    policy._latest_monitor_time = float("-inf")
    below = SimpleNamespace(start_time=float("-inf"), num_workers=2)
    grown = policy.make_decision_for_running_worker_group(below, None)
    assert isinstance(grown, ResizeDecision) and grown.num_workers == 3, grown


BAD = {
    "negative": (["parallelism.min_dp=-1"], "must be >= 0"),
    "above-dp": (elastic(min_dp=4), "must be <= parallelism.dp=3"),
    # 3 micro-batches a step (one per replica at dp=3): 2 replicas cannot split them.
    "no-smaller-dp": (
        elastic(min_dp=2, microbatches=1),
        "no dp in [2, 2] splits the step's 3 micro-batches of 4 rows",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_min_dp_is_refused_naming_key_value_and_fix(name):
    overrides, message = BAD[name]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*MODEL, *elastic(), *overrides])
    assert err.value.key == "parallelism.min_dp" and message in err.value.fix, err.value.fix
    assert str(err.value.value) in str(err.value)
    if name == "no-smaller-dp":  # both fixes are layouts the check accepts
        assert "parallelism.min_dp=1" in err.value.fix and "parallelism.microbatches=2 " in err.value.fix
        for fix in (["parallelism.min_dp=1"], ["parallelism.microbatches=2"]):
            assert len(usable_dps(load_config(None, [*MODEL, *elastic(), *overrides, *fix]).parallelism)) > 1


def test_check_lists_the_dp_values(capsys):
    sets = [a for s in (*MODEL, *elastic(pp=2)) for a in ("--set", s)]
    assert cli.main(["check", *sets, "--topology", "2,2,2"]) == 0
    out = capsys.readouterr().out
    assert "elastic: dp in {1, 2, 3} (2 workers a replica)" in out, out
    assert "dp=1: 6, dp=2: 3, dp=3: 2" in out, out
    assert cli.main(["check", *sets, "--topology", "2,2,2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dp_values"] == [1, 2, 3]


# ------------------------------------------------------------------ the engine across a resize


# Preemption notices heard by one rank alone before a step (rank, step): "plain" at step 2
# (index; its end is step_3, between the interval's saves), "zero1" at step 1 (step_2, which
# the interval saves anyway: one save).
NOTICES = {"plain": (2, 2), "zero1": (1, 1)}


# An elastic run with layout=auto, replicas of tp=2 workers as configured, priced on H100s: each
# start picks the layout of all its workers (the pick the tiny model gets: its step is all latency).
AUTO = [*elastic(3, 1, 2, 1, "parallelism.tp=2", "parallelism.layout=auto")]
AUTO_HW = dataclasses.asdict(PROFILES["h100"])


@pytest.fixture(scope="module")
def resized(tmp_path_factory):
    """Each case saved at dp=3 (checkpoints after steps 2 and 4, and at a preemption notice)
    and resumed from step 2 on fewer workers with the same config: "plain" and "zero1" on 3
    then 2 workers, "pp2" and "cp2" (context parallelism) on 6 then 4, "auto" on 6 workers of
    three nodes then 2 of one node. One launch of gloo processes per world size and half."""
    cases = {
        "plain": elastic(),
        "zero1": elastic(3, 1, 2, 1, "parallelism.zero=1"),
        "pp2": elastic(pp=2),
        "auto": AUTO,
        "cp2": elastic(3, 1, 2, 1, "parallelism.cp=2"),  # context parallelism kept across the resize
    }
    nodes = {"auto": (3, 1)}  # fake nodes the ranks spread over, in each half
    root = tmp_path_factory.mktemp("elastic")
    jobs = {n: [*MODEL, *o, "checkpoint.interval=2", f"run.output_dir={root / n}"] for n, o in cases.items()}

    def job(n: str, half: int, **more) -> dict:
        extra = {"nodes": nodes[n][half], "auto_hardware": AUTO_HW} if n in nodes else {}
        return {**more, **extra, **({"notice": NOTICES[n]} if n in NOTICES and half == 0 else {})}

    saved, resumed = {}, {}
    for world, names in ((3, ("plain", "zero1")), (6, ("pp2", "auto", "cp2"))):
        saved.update(run_gloo_jobs(world, {n: job(n, 0, overrides=jobs[n]) for n in names}))
    for world, names in ((2, ("plain", "zero1", "auto")), (4, ("pp2", "cp2"))):
        again = {
            n: job(
                n,
                1,
                overrides=[*jobs[n][:-1], f"run.output_dir={root / n}-dp2"],
                resume=str(root / n / "checkpoints" / "step_2"),
            )
            for n in names
        }
        resumed.update(run_gloo_jobs(world, again))
    return root, saved, resumed


@pytest.mark.parametrize("name", ["plain", "zero1", "pp2", "cp2"])
def test_a_run_resized_from_dp3_to_dp2_trains_the_oracle_model(resized, name):
    root, saved, resumed = resized
    reference = reference_history(REFERENCE)
    assert_oracle(saved[name], reference)
    assert_oracle(resumed[name], reference, first=2)
    assert [h["dp"] for h in saved[name]["history"]] == [3] * 4
    assert [h["dp"] for h in resumed[name]["history"]] == [2] * 2
    manifest = read_manifest(root / f"{name}-dp2" / "checkpoints" / "step_4")
    replica = 2 if name in ("pp2", "cp2") else 1  # workers a replica: pp=2, cp=2
    assert manifest["world_size"] == 2 * replica
    assert (manifest["layout"]["dp"], manifest["layout"]["microbatches"]) == (2, 3)


@pytest.mark.parametrize("name", sorted(NOTICES))
def test_a_preemption_notice_heard_by_one_rank_is_saved_by_all_at_the_same_step(resized, name):
    """The vote rides on the step's loss all-reduce: every rank saves at the end of the step it
    was cast in (rank 0 says so too, though it heard nothing), once; the steps are unchanged."""
    root, saved, _ = resized
    done = NOTICES[name][1] + 1
    assert saved[name]["noticed_at"] == done
    steps = sorted(int(p.name.split("_")[1]) for p in (root / name / "checkpoints").glob("step_*"))
    assert steps == sorted({2, done, 4}), steps
    assert read_manifest(root / name / "checkpoints" / f"step_{done}")["step"] == done
    assert_oracle(saved[name], reference_history(REFERENCE))


def test_an_elastic_auto_run_picks_each_starts_layout_and_trains_the_oracle_model(resized):
    """parallelism.layout=auto with min_dp: each start (as a Ray worker group's, launch.runtime.entry)
    picks the planner's best layout of all its workers on their nodes, not the configured
    tp=2: 6 workers on three nodes of 2 -> dp=6 under ZeRO-1 with hybrid sharding (replicate=3 x
    shard=2, a shard group a node: a reduce-scatter inside the node and a 3-way all-reduce across
    nodes cost this latency-bound step less than a flat 6-way one, or dp=3 pp=2's bubble),
    resumed on 2 workers of one node -> dp=2 tp=1 pp=1 from the first's checkpoint (its ZeRO-1
    slices resharded). Both halves are the single-process oracle's steps."""
    root, saved, resumed = resized
    reference = reference_history(REFERENCE)
    assert_oracle(saved["auto"], reference)
    assert_oracle(resumed["auto"], reference, first=2)
    shapes = []
    for run, step in ((root / "auto", 2), (root / "auto-dp2", 4)):
        layout = read_manifest(run / "checkpoints" / f"step_{step}")["layout"]
        shapes.append((layout["dp"], layout["tp"], layout["pp"]))
    assert shapes == [(6, 1, 1), (2, 1, 1)], shapes
    first, again = saved["auto"]["said"], resumed["auto"]["said"]
    assert first[0].startswith("layout auto: dp=6 tp=1 pp=1 ") and " zero=1 replicate=3 " in first[0], first
    assert "for the 6 workers started on nodes holding [2, 2, 2] (H100-80GB SXM)" in first[0], first
    assert again[0].startswith("layout auto: dp=2 tp=1 pp=1 ") and "nodes holding [2] " in again[0], again
    assert first[1].startswith("layout auto: runner-up "), first
