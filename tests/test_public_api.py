"""The names a user scripts against (raytrain_hybrid/__init__.py), used as a script would."""

from __future__ import annotations

import pytest

import raytrain_hybrid as rh


def test_public_names_are_documented():
    """Every public name says what it takes (an ``Args:`` entry per parameter) and, a function,
    what it gives back (``Returns:``)."""
    import inspect

    for name in rh.__all__:
        obj = getattr(rh, name)
        doc = inspect.getdoc(obj) or ""
        assert doc and not doc.startswith(f"{name}("), f"raytrain_hybrid.{name} has no docstring of its own"
        assert "\nArgs:\n" in doc, f"raytrain_hybrid.{name}: no Args: section"
        if inspect.isfunction(obj):
            assert "\nReturns:\n" in doc, f"raytrain_hybrid.{name}: no Returns: section"
            params = inspect.signature(obj).parameters
        else:
            params = {f.name: f for f in getattr(obj, "__dataclass_fields__", {}).values()}
        args = doc.split("\nArgs:\n", 1)[1]
        for param in params:
            assert f"\n    {param}: " in "\n" + args, f"raytrain_hybrid.{name}: Args: does not say {param}"


def test_train_and_export_take_what_the_cli_takes():
    """Each option of `train` and `export` that is not about the terminal or the config file is a
    parameter of rh.train / rh.export, under the same name."""
    import argparse
    import inspect

    from raytrain_hybrid.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    cli_only = {"help", "config", "overrides", "address", "verbose"}  # the config is rh.load_config's
    for command, fn in (("train", rh.train), ("export", rh.export)):
        options = {a.dest for a in commands[command]._actions} - cli_only
        assert options and options <= set(inspect.signature(fn).parameters), (command, options)


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


def test_check_returns_the_plan_check_prints_and_refuses_what_train_refuses(tmp_path, capsys):
    """rh.check's plan is the RunPlan `check --json` prints for the same config and nodes; what
    `train` refuses before its first step, rh.check raises, in the CLI's words."""
    import json

    from raytrain_hybrid import cli

    def check_json(sets):  # the CLI's check of the same config on the same nodes
        return ["check", "--topology", "4,4", "--json", *(a for s in sets for a in ("--set", s))]

    sets = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", f"run.output_dir={tmp_path / 'run'}"]
    sets.append("run.shared_fs=true")
    cfg = rh.load_config(None, [*sets, "data.path=memory"])
    plan = rh.check(cfg, topology=[4, 4])["plan"]
    assert plan.lines()[0].startswith("start: dp=2 tp=2 pp=2, 8 workers (1 CPU, 1 GPU each) on nodes holding [4, 4]")
    assert plan.asked is cfg and plan.for_workers().cfg == plan.cfg and not (tmp_path / "run").exists()
    assert cli.main(check_json([*sets, "data.path=memory"])) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == json.loads(json.dumps(plan.to_json()))
    missing = [*sets, f"data.path={tmp_path / 'nope.parquet'}"]
    with pytest.raises(rh.ConfigError) as refused:
        rh.check(rh.load_config(None, missing), topology=[4, 4])
    assert "does not exist" in str(refused.value)
    assert cli.main(check_json(missing)) == 2 and capsys.readouterr().err == f"error: {refused.value}\n"


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
    monkeypatch.setattr(
        "raytrain_hybrid.launch.runtime.driver.run",
        lambda cfg, resume=None, allow_change=None: seen.update(run=(resume, allow_change)) or {},
    )
    monkeypatch.setattr(
        "raytrain_hybrid.checkpoint.export.export_hf",
        lambda src, out, merge=False: seen.update(export=(src, merge)) or str(out),
    )
    cfg = rh.load_config(None, [f"run.output_dir={tmp_path}"])
    assert rh.train(cfg, resume="runs/x", allow_change=["train.lr"]) == {}
    assert rh.export("runs/x", tmp_path / "hf", merge=True) == str(tmp_path / "hf")
    assert seen == {"run": ("runs/x", ["train.lr"]), "export": ("runs/x", True)}


def test_train_checks_allow_change_before_anything_starts(tmp_path):
    """allow_change reaches the resume check of `train --allow-change` (before Ray starts, before a
    checkpoint is read): a key that a resume does not compare is refused as the CLI refuses it."""
    cfg = rh.load_config(None, [f"run.output_dir={tmp_path / 'run'}", "data.path=memory"])
    with pytest.raises(rh.ConfigError, match="--allow-change='checkpoint.interval': is not a key a resume compares"):
        rh.train(cfg, resume=str(tmp_path / "elsewhere"), allow_change=["checkpoint.interval"])
    assert not (tmp_path / "run").exists()  # a refused run leaves no directory
