"""A layout sweep of 3 layouts runs end to end with Ray Tune on the session's local Ray."""

from __future__ import annotations

import json

from raytrain_hybrid.config import load_config
from raytrain_hybrid.planner.hardware import PROFILES
from raytrain_hybrid.tools.sweep import sweep


def test_sweep_three_layouts(ray_local, tmp_path, capsys):
    cfg = load_config(None, ["model.num_layers=2", "model.seq_len=64", "train.global_batch_size=8", "data.path=memory"])
    rows = sweep(cfg, 2, PROFILES["h100"], top=3, steps=3, out_dir=tmp_path)
    assert len(rows) == 3
    assert len({(r["dp"], r["tp"], r["pp"], r["schedule"], r["zero"]) for r in rows}) == 3
    for r in rows:
        assert not r["failed"], r
        assert r["measured_tokens_per_s"] > 0 and r["param_bytes"] > 0
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["name"] for r in saved] == [r["name"] for r in rows]
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 4
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    shown = capsys.readouterr().out  # progress without a terminal: one line per finished trial
    assert [line.split()[1] for line in shown.splitlines() if line.startswith("sweep ")] == ["1/3", "2/3", "3/3"]
    assert "tokens/s" in shown


def test_failed_trial_is_recorded_and_the_sweep_goes_on(ray_local, tmp_path):
    cfg = load_config(
        None,
        ["model.num_layers=2", "model.seq_len=64", "train.global_batch_size=8", f"data.path={tmp_path / 'missing'}"],
    )
    rows = sweep(cfg, 2, PROFILES["h100"], top=2, steps=2, out_dir=tmp_path / "out")
    assert len(rows) == 2
    assert all(r["failed"] and "data.path" in r["reason"] for r in rows), rows
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())[0]["failed"] is True
