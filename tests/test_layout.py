"""Layout math without a process group: rank arrangement, stage splits, axis groups."""

from __future__ import annotations

import json

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks, axis_groups
from raytrain_hybrid.distributed.pipeline import split_layers, stage_ids
from raytrain_hybrid.errors import LayoutError


def test_split_layers_is_contiguous_and_complete():
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            split = split_layers(layers, stages)
            assert [i for s in split for i in s] == list(range(layers))
            sizes = [len(s) for s in split]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    # uneven: the middle stages take the extra blocks, not the embedding/head stages
    assert [len(s) for s in split_layers(6, 4)] == [1, 2, 2, 1]


def test_stage_ids_looped_and_v():
    assert stage_ids("Interleaved1F1B", 1, 4, 2) == [1, 5]
    assert stage_ids("ZBVZeroBubble", 1, 4, 2) == [1, 6]
    assert stage_ids("DualPipeV", 0, 2, 2) == [0, 3]
    assert stage_ids("1F1B", 3, 4, 1) == [3]


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (1, 4, 2)])
def test_tp_groups_stay_on_a_node_with_interleaved_ranks(dp, tp, pp):
    """(1,4,2): a TP group fills a 4-worker node (on two simulated nodes through Ray Train:
    tests/test_topology_ray.py, at (2,2,2))."""
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    # Ray handed out ranks alternating between two nodes.
    nodes = ["a", "b"] * 4
    arrangement = arrange_ranks(dims, nodes)
    groups = axis_groups(dims, arrangement)
    for group in groups["tp"]:
        assert len({nodes[r] for r in group}) == 1
    for group in groups["pp"]:
        assert len({nodes[r] for r in group}) == 2
    assert sorted(arrangement) == list(range(8))


def test_every_group_ascends_as_torchs_device_mesh_numbers_it():
    """DeviceMesh numbers a group's members by ascending global rank: a group laid out in another
    order gives ranks the wrong coordinates (ranks 0..5 on three nodes, alternating, at dp=3 pp=2
    once built stage 0 on a rank of stage 1). Orders that can be laid out ascend on every axis;
    one that cannot is refused, naming the group."""
    for dims, nodes in (
        (ParallelDims(dp=3, tp=1, pp=2), ["a", "b", "c"] * 2),
        (ParallelDims(dp=1, tp=2, pp=2), ["a", "b"] * 2),
        (ParallelDims(dp=2, tp=2, pp=2), ["a", "b"] * 4),
    ):
        groups = axis_groups(dims, arrange_ranks(dims, nodes))
        assert all(g == sorted(g) for gs in groups.values() for g in gs), (dims, groups)
        assert all(len({nodes[r] for r in g}) == 1 for g in groups["tp"])
    # Node a holds ranks 0 and 3, node b 1 and 2: TP pairs [0, 3] and [1, 2], whose second members
    # descend along dp.
    with pytest.raises(LayoutError, match=r"the dp group \[3, 2\] would not ascend"):
        arrange_ranks(ParallelDims(dp=2, tp=2, pp=1), ["a", "b", "b", "a"])


def test_tp_larger_than_node_is_refused():
    with pytest.raises(LayoutError, match="tp=8"):
        arrange_ranks(ParallelDims(dp=1, tp=8, pp=1), ["a"] * 4 + ["b"] * 4)


def test_uneven_nodes():
    with pytest.raises(LayoutError, match=r"\[3, 5\]"):
        arrange_ranks(ParallelDims(dp=1, tp=4, pp=2), ["a"] * 3 + ["b"] * 5)
    arrangement = arrange_ranks(ParallelDims(dp=4, tp=1, pp=2), ["a"] * 3 + ["b"] * 5)
    assert sorted(arrangement) == list(range(8))


def test_check_json(capsys):
    assert (
        cli.main(["check", "--set", "parallelism.tp=4", "--set", "parallelism.dp=1", "--topology", "4,4", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["ranks"]) == 8
    for group in out["groups"]["tp"]:
        assert len({out["ranks"][r]["node"] for r in group}) == 1
    assert (
        cli.main(
            [
                "check",
                "--set",
                "parallelism.tp=8",
                "--set",
                "parallelism.dp=1",
                "--set",
                "parallelism.pp=1",
                "--set",
                "model.num_heads=8",
                "--set",
                "model.ffn_hidden_size=512",
                "--topology",
                "4,4",
            ]
        )
        == 2
    )
    assert "tp=8" in capsys.readouterr().err


def _brute_force(dims: ParallelDims, counts: list[int]) -> dict:
    """Every group and node crossing, enumerated rank by rank (what check listed before it summarized)."""
    nodes = [i for i, c in enumerate(counts) for _ in range(c)]
    groups = axis_groups(dims, list(range(dims.world_size)))
    shard = dims.dp // dims.replicate
    if dims.replicate > 1:
        groups["shard"] = [g[i : i + shard] for g in groups["dp"] for i in range(0, dims.dp, shard)]
        groups["replicate"] = [g[i::shard] for g in groups["dp"] for i in range(shard)]
    crossing = {k: (sum(len({nodes[r] for r in g}) > 1 for g in gs), len(gs)) for k, gs in groups.items()}
    return {"groups": groups, "crossing": crossing, "nodes": nodes}


@pytest.mark.parametrize(
    ("dims", "counts"),
    [
        (ParallelDims(dp=2, tp=2, pp=2), [4, 4]),
        (ParallelDims(dp=4, tp=1, pp=2), [3, 5]),
        (ParallelDims(dp=3, tp=2, pp=2, cp=2), [8, 8, 8]),
        (ParallelDims(dp=2, tp=2, pp=1, cp=4), [4, 4, 8]),
        (ParallelDims(dp=4, tp=2, pp=1, zero=3, replicate=2), [4, 4]),
        (ParallelDims(dp=6, tp=1, pp=2, zero=1, replicate=3), [2, 4, 6]),
        (ParallelDims(dp=4, tp=2, pp=2, cp=2, zero=2, replicate=2), [8, 8, 16]),
    ],
)
def test_placement_report_is_the_enumeration_it_replaces(dims, counts):
    """check's placement is worked out from the nodes, not rank by rank: its groups, nodes and
    node crossings (cp, hybrid sharding's shard and replica groups) are those enumerated."""
    from raytrain_hybrid.distributed.parallel_dims import cp_placement, hsdp_placement, placement_report

    got, want = placement_report(dims, counts), _brute_force(dims, counts)
    assert got["groups"] == want["groups"]
    assert [r["node"] for r in got["ranks"]] == [f"node{n}" for n in want["nodes"]]
    assert [{k: v for k, v in r.items() if k not in ("rank", "node")} for r in got["ranks"]] == [
        dims.coords(r) for r in range(dims.world_size)
    ]
    assert got["totals"]["ranks"] == dims.world_size
    assert all(got["totals"][k]["groups"] == len(gs) for k, gs in want["groups"].items())
    if dims.cp > 1:
        assert got["cp_placement"] == cp_placement(dims, want["crossing"]["cp"])
    if dims.replicate > 1:
        assert (got["hsdp_placement"], got["hsdp_where"]) == hsdp_placement(dims, want["groups"], want["crossing"])


def test_check_of_an_enormous_layout_lists_a_bounded_part(capsys, monkeypatch):
    """dp=200,000 (800,000 ranks): check lists the first ranks and groups and says how many
    there are, working out no rank it does not list (it enumerated all: 19 s)."""
    from raytrain_hybrid.distributed import parallel_dims

    worked: list[int] = []
    coords = ParallelDims.coords
    monkeypatch.setattr(ParallelDims, "coords", lambda self, slot: worked.append(slot) or coords(self, slot))
    sets = ["parallelism.dp=200000", "train.global_batch_size=800000", "parallelism.pp=2", "parallelism.tp=2"]
    assert cli.main(["check", *[a for s in sets for a in ("--set", s)], "--topology", "400000,400000"]) == 0
    out = capsys.readouterr().out
    listed = parallel_dims.LISTED_RANKS
    assert len(worked) <= 2 * listed, len(worked)
    assert len(out.splitlines()) < listed + 40 and len(out) < 100_000, len(out)
    assert f"... and {800_000 - listed:,} more ranks (the first {listed} of 800,000 listed)" in out
    assert "dp groups (4 of 200,000 ranks each; the first 4 listed, each cut to its first 64 ranks): " in out
    assert "tp groups (400,000 of 2 ranks each; the first 64 listed): [[0, 1], [2, 3]," in out
    assert "pp groups (400,000 of 2 ranks each; the first 64 listed): [[0, 400000], [1, 400001]," in out
    assert cli.main(["check", *[a for s in sets for a in ("--set", s)], "--topology", "400000,400000", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["ranks"]) == listed and got["totals"]["dp"] == {"groups": 4, "size": 200_000}
    assert got["ranks"][-1] == {"rank": listed - 1, "node": "node0", "pp": 0, "dp": listed // 2 - 1, "tp": 1}


def test_predicted_placement():
    from raytrain_hybrid.launch.plan.placement import predict_workers_per_node

    nodes = [{"CPU": 1}, {"CPU": 4, "GPU": 4}, {"CPU": 4, "GPU": 4}]
    gpu = {"CPU": 1, "GPU": 1}
    assert predict_workers_per_node(nodes, 8, gpu, "PACK") == [4, 4]
    assert predict_workers_per_node(nodes, 6, gpu, "PACK") == [4, 2]
    assert predict_workers_per_node(nodes, 4, gpu, "SPREAD") == [2, 2]
    assert predict_workers_per_node(nodes, 2, gpu, "STRICT_SPREAD") == [1, 1]
    assert predict_workers_per_node(nodes, 9, gpu, "PACK") is None  # waits for the autoscaler
    assert predict_workers_per_node(nodes, 9, {"CPU": 1}, "PACK") == [1, 4, 4]  # node order


def test_check_json_uneven_nodes(capsys):
    base = ["check", "--set", "parallelism.dp=1", "--set", "parallelism.pp=2", "--json"]
    assert cli.main([*base, "--set", "parallelism.tp=4", "--topology", "3,5"]) == 2
    err = capsys.readouterr().err
    assert "[3, 5]" in err and "tp in [1]" in err
    assert cli.main([*base, "--set", "parallelism.tp=1", "--set", "parallelism.dp=4", "--topology", "3,5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["rank"] for r in out["ranks"]) == list(range(8))
    assert [len(g) for g in out["groups"]["pp"]] == [2, 2, 2, 2]


# Each output that reports a layout keeps the keys and order it has always written.
SUMMARY_LAYOUT = ["dp", "tp", "pp", "microbatches", "schedule", "zero", "virtual_stages", "activation_checkpointing"]
MANIFEST_LAYOUT = ["dp", "tp", "pp", "schedule", "zero", "virtual_stages", "microbatches"]
PLAN_JSON = ["dp", "tp", "pp", "microbatches", "schedule", "zero", "activation_checkpointing", "feasible", "reason"]


@pytest.mark.parametrize(
    ("overrides", "virtual"),
    [([], 1), (["parallelism.schedule=Interleaved1F1B", "model.num_layers=8"], 2), (["parallelism.pp=1"], 1)],
)
def test_layout_outputs_keep_their_keys(overrides, virtual):
    from raytrain_hybrid.checkpoint.manifest import layout_of
    from raytrain_hybrid.config import LAYOUT_KEYS, load_config
    from raytrain_hybrid.launch.records.summary import summarize
    from raytrain_hybrid.tools.sweep import set_line

    cfg = load_config(None, ["parallelism.dp=2", *overrides])
    par = cfg.parallelism
    summary = summarize(cfg, [], [])["layout"]
    assert list(summary) == SUMMARY_LAYOUT and summary["virtual_stages"] == virtual
    manifest = layout_of(cfg)
    assert list(manifest) == MANIFEST_LAYOUT and manifest["virtual_stages"] == virtual
    assert all(summary[k] == getattr(par, k) for k in SUMMARY_LAYOUT if k != "virtual_stages")
    layout = {k: getattr(par, k) for k in LAYOUT_KEYS}
    assert [item.split("=")[0] for item in set_line(layout).split()[1::2]] == [f"parallelism.{k}" for k in LAYOUT_KEYS]


def test_planner_rows_carry_every_layout_key(capsys):
    from raytrain_hybrid.config import LAYOUT_KEYS, load_config
    from raytrain_hybrid.planner.hardware import PROFILES
    from raytrain_hybrid.planner.search import plan

    rows = plan(load_config(), 8, PROFILES["h100"])
    assert {k for k in rows[0] if k in LAYOUT_KEYS} == set(LAYOUT_KEYS)
    assert cli.main(["plan", "--world-size", "8", "--gpus-per-node", "8", "--json", "--top", "1"]) == 0
    shown = json.loads(capsys.readouterr().out)[0]
    assert list(shown)[: len(PLAN_JSON)] == PLAN_JSON and "sequence_parallel" not in shown
