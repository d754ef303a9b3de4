"""Until the first step, the driver says every few seconds what a run waits for (launch.runtime.waiting)."""

from __future__ import annotations

import ray

from raytrain_hybrid.launch.runtime.waiting import Waiting


def test_a_line_every_few_seconds_saying_what_the_start_waits_for(monkeypatch):
    waiting = Waiting(since=100.0, every_s=10.0)
    assert [t for t in (101.0, 109.9, 110.0, 112.0, 120.5) if waiting.due(t)] == [110.0, 120.5]

    # Ray cannot place the worker group: its size, what each worker asks, and what is free.
    pending = {"pg": {"state": "PENDING", "bundles": {i: {"CPU": 1.0} for i in range(8)}}}
    monkeypatch.setattr(ray.util, "placement_group_table", lambda: pending)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 2.0, "memory": 1e9})
    line = waiting.what(0, now=130.0)
    assert line.startswith("waiting 30 s for the first step: Ray has not placed the 8 workers yet")
    assert "each asks {'CPU': 1.0}; free now {'CPU': 2.0}" in line and "autoscaler" in line

    # Placed: the workers are starting; then, once rank 0 said it started, the model and the first batch.
    monkeypatch.setattr(ray.util, "placement_group_table", lambda: {"pg": {"state": "CREATED", "bundles": {}}})
    assert "the workers are starting" in waiting.what(0, now=140.0)
    assert "building the model" in waiting.what(1, now=150.0)
    # A state query that fails costs the line its detail, not the run.
    monkeypatch.setattr(ray.util, "placement_group_table", lambda: 1 / 0)
    assert "the workers are starting" in waiting.what(0, now=160.0)
