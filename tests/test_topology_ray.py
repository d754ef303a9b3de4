"""Placement on a simulated 2-node cluster (4 fake GPUs each): TP inside a node, PP across.

The layouts run through the real launcher (Ray Train places the workers), the
mesh is laid over the nodes Ray chose, and the oracle still holds.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import reference_history

STEPS = 3
COMMON = (f"train.steps={STEPS}", "model.num_layers=4", "train.global_batch_size=16", "data.path=memory")
HERE = Path(__file__).resolve().parent


def _layout(dp, tp, pp, m):
    return [f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.microbatches={m}"]


@pytest.fixture(scope="module")
def two_nodes():
    cases = {
        "1x4x2": [*COMMON, *_layout(1, 4, 2, 2), "train.steps=1"],
        "2x2x2": [*COMMON, *_layout(2, 2, 2, 4)],
        "tp8": [*COMMON, *_layout(1, 8, 1, 1), "model.num_heads=8", "model.ffn_hidden_size=512"],
        # A directory on the driver's disk, not declared shared: each node would keep its own part.
        "local_out": [*COMMON, *_layout(2, 2, 2, 4), "run.shared_fs=false"],
    }
    spec = {"nodes": [4, 4], "cases": cases}
    argv = [sys.executable, str(HERE / "multinode_driver.py"), json.dumps(spec)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The oracle test's reference, cached while the cluster starts (a failure shows there).
        with contextlib.suppress(Exception):
            reference_history(COMMON)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _groups(per_rank, key_axes):
    groups: dict[tuple, set] = {}
    for r in per_rank:
        groups.setdefault(tuple(r[a] for a in key_axes), set()).add(r["node"])
    return groups


@pytest.mark.parametrize("name", ["1x4x2", "2x2x2"])
def test_tp_inside_node_pp_across_nodes(two_nodes, name):
    result = two_nodes[name]
    assert "error" not in result, result
    per_rank = result["per_rank"]
    assert len(per_rank) == 8 and len({r["node"] for r in per_rank}) == 2
    assert all(len(nodes) == 1 for nodes in _groups(per_rank, ("pp", "dp")).values())  # TP groups
    assert all(len(nodes) == 2 for nodes in _groups(per_rank, ("dp", "tp")).values())  # PP groups


def test_oracle_holds_on_two_nodes(two_nodes):
    history = two_nodes["2x2x2"]["history"]
    for got, want in zip(history, reference_history(COMMON), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_tp_larger_than_a_node_fails_with_workers_per_node(two_nodes):
    error = two_nodes["tp8"].get("error", "")
    assert "tp=8" in error and "[4, 4]" in error, error


def test_a_local_output_dir_on_two_nodes_is_refused_naming_the_fix(two_nodes):
    error = two_nodes["local_out"].get("error", "")
    assert "run.output_dir" in error and "the cluster has" in error, error
    assert "s3://" in error and "run.shared_fs=true" in error, error
