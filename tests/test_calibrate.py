"""calibrate measures this machine into a profile the planner loads."""

from __future__ import annotations

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.planner.hardware import load_hardware
from raytrain_hybrid.planner.search import plan


def test_calibrate_writes_a_loadable_profile(tmp_path):
    path = tmp_path / "local.json"
    assert cli.main(["calibrate", "--out", str(path)]) == 0
    hw = load_hardware(str(path))
    assert hw.peak_tflops > 0 and hw.intra_node_gbps > 0 and hw.latency_s > 0 and hw.memory_bytes > 1e9
    rows = plan(load_config(), 4, hw)
    assert rows and rows[0]["feasible"]
