"""Faults injected across checkpoint saves, nothing lost: a seeded sample of the campaign that
benchmarks/bench_faults.py runs in full (benchmarks/results/faults.json).

Each trial (tests/fault_trial.py) trains a tiny Llama on 2 gloo ranks with a checkpoint after
every step, kills a worker or the driver with its job (SIGKILL) at a point of one save, restarts
the way ``train --resume <run dir>`` does (the driver's start: the newest intact checkpoint, the
trajectory check, the run's lease) and trains to the end. Every loss after the restart must equal
the uninterrupted run's, every checkpoint complete when the fault fired must be intact after it
and at the end, and the user's files in and beside the run directory must be unchanged.
"""

from __future__ import annotations

import random

import fault_injection as fi
import fault_trial as ft
import pytest
from s3_server import fresh_buckets

STEPS = 4
SEED = 33  # draws the driver killed right after step_2's rename: the resume must start there
# Points that fire at the same place in every run (no timers): the sample is the same each time.
LOCAL_POINTS = {"dcp_write": 1, "hash": 1, "fsync_dir": 1, "rename": 1, "after_rename": 1}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ctx = fi.context()
    return ctx, ft.reference(ctx, "local", tmp_path_factory.mktemp("faults") / "reference", {}, steps=STEPS)


def assert_nothing_lost(row: dict) -> None:
    assert row["fired"] and row["first_run"] == "killed", row
    assert row["second_run"] == "ok" and row["losses_equal"] is True, row
    assert row["resumed_from_newest_complete"] and row["final_checkpoint_intact"], row
    assert row["checkpoints_lost"] == [] and row["user_files_changed"] == 0, row


def test_a_local_save_killed_at_a_sampled_point_resumes_to_the_same_losses(uninterrupted, tmp_path):
    ctx, calib = uninterrupted
    fault = ft.sample_fault(random.Random(SEED), "local", calib, LOCAL_POINTS, steps=STEPS)
    row = ft.trial(ctx, "local", tmp_path / "t0", fault, calib, {}, steps=STEPS)
    assert_nothing_lost(row)
    assert row["complete_when_fired"], row  # this sample kills after a checkpoint was complete


def test_s3_driver_killed_before_the_first_manifest_starts_again(uninterrupted, tmp_path):
    """On S3 the first save's shards are uploaded, the driver and its job are killed before the
    manifest: nothing to resume (``--resume`` says so), and a fresh ``train`` in that directory
    starts (the cut-short step_1/ is no one's checkpoint) and trains the same steps."""
    ctx, calib = uninterrupted
    env = fresh_buckets("faults")
    fault = {"point": "manifest", "step": 1, "rank": 0, "target": "driver"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)  # this process checks the bucket too
        row = ft.trial(ctx, "s3", tmp_path / "t0", fault, calib, env, steps=STEPS)
    assert row["restart"] == "fresh" and "manifest.json is missing" in row["resume_refused"], row
    assert_nothing_lost(row)


def test_the_campaign_fails_when_it_finds_a_checkpoint_lost():
    """benchmarks/bench_faults.py exits 1 (failures) when a summary counts a complete checkpoint
    lost, a save completed by a killed run after the resume's pick, a missing step or other
    losses; the committed campaigns' results count none."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("bench_faults", root / "benchmarks" / "bench_faults.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ray = json.loads((root / "benchmarks/results/faults_ray.json").read_text())
    local = json.loads((root / "benchmarks/results/faults.json").read_text())
    assert bench.failures(ray) == [] and bench.failures(local) == []
    ray["ray_driver_kills"].pop("from_an_earlier_run", None)
    for key, value in (("complete_checkpoints_lost", 1), ("steps_missing_from_metrics_jsonl", 2),
                       ("runs_whose_every_loss_equals_the_uninterrupted_run", 19)):  # fmt: skip
        doctored = json.loads(json.dumps(ray))
        doctored["ray_driver_kills"]["summary"][key] = value
        assert bench.failures(doctored), key
