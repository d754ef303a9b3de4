"""The names a user scripts against (raytrain_hybrid/__init__.py), used as a script would."""

from __future__ import annotations

import pytest

import raytrain_hybrid as rh


def test_public_names_are_documented():
    for name in rh.__all__:
        obj = getattr(rh, name)
        assert (obj.__doc__ or "").strip(), f"raytrain_hybrid.{name} has no docstring"


def test_check_places_ranks_and_prices_the_layout():
    cfg = rh.load_config(None, ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"])
    report = rh.check(cfg, topology=[4, 4], hardware="h100")
    assert [r["rank"] for r in report["ranks"]] == list(range(8))
    # TP groups are consecutive ranks on one node; PP stages go across the two nodes.
    assert report["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    nodes = {r["rank"]: r["node"] for r in report["ranks"]}
    assert all(len({nodes[r] for r in g}) == 1 for g in report["groups"]["tp"])
    assert all(len({nodes[r] for r in g}) == 2 for g in report["groups"]["pp"])
    assert "H100" in report["planner"] and "fits" in report["planner"]


def test_check_refuses_tp_across_nodes():
    cfg = rh.load_config(None, ["parallelism.dp=1", "parallelism.tp=4", "parallelism.pp=2"])
    with pytest.raises(rh.LayoutError, match="tp=4"):
        rh.check(cfg, topology=[2, 2, 2, 2])


def test_plan_ranks_layouts_of_the_world_size():
    cfg = rh.load_config(None, [])
    rows = rh.plan(cfg, world_size=8, hardware="h100")
    assert rows and all(r["dp"] * r["cp"] * r["tp"] * r["pp"] == 8 for r in rows)  # ep is carved from dp
    feasible = [r for r in rows if r["feasible"]]
    assert feasible[0]["predicted_tokens_per_s"] == max(r["predicted_tokens_per_s"] for r in feasible)


def test_train_and_export_reach_the_launcher_and_the_exporter(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr("raytrain_hybrid.launch.driver.run", lambda cfg, resume=None: seen.update(run=resume) or {})
    monkeypatch.setattr("raytrain_hybrid.checkpoint.export.export_hf", lambda src, out: seen.update(export=src) or out)
    cfg = rh.load_config(None, [f"run.output_dir={tmp_path}"])
    assert rh.train(cfg, resume="runs/x") == {}
    assert rh.export("runs/x", tmp_path / "hf") == tmp_path / "hf"
    assert seen == {"run": "runs/x", "export": "runs/x"}
