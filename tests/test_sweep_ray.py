"""Layout sweeps with Ray Tune: the planner's 2 best distinct layouts end to end from the CLI into an
S3 bucket (a real S3 endpoint, moto's server, found through AWS_ENDPOINT_URL alone), on the
session's cluster; a failing trial on the session's local Ray.

Two trials, not three: each is a Ray Train worker group of its own (a Tune trial process, the
controller, two workers: ~40 s of the suite's CPU), and every assertion here (distinct layouts,
a run directory per trial, one progress line per finished trial, Tune's state in the bucket)
holds for two as for three."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.fs as pafs
from s3_server import s3_server

from raytrain_hybrid.config import load_config
from raytrain_hybrid.planner.hardware import PROFILES
from raytrain_hybrid.tools.sweep import sweep


def test_sweep_two_layouts_into_a_bucket(ray_local, tmp_path):
    sets = ["model.num_layers=2", "model.seq_len=64", "train.global_batch_size=8", "data.path=memory"]
    args = ["sweep", "--world-size", "2", "--top", "2", "--steps", "3", "--hardware", "h100"]
    with s3_server() as env:
        fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"])
        done = subprocess.run(
            [sys.executable, "-m", "raytrain_hybrid.cli", *args, "--out", "s3://bucket/sweep"]
            + [a for o in sets for a in ("--set", o)],
            cwd=tmp_path,
            # The session's cluster (started with the bucket's endpoint and keys in its environment)
            # through RAY_ADDRESS, as a user with a running cluster: no Ray start of its own.
            env={**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

        def read(path: str) -> bytes:
            with fs.open_input_stream(f"bucket/sweep/{path}") as f:
                return f.read()

        rows = json.loads(read("sweep.json"))
        assert read("sweep.csv").decode().count("\n") == 3  # the header and a row per trial
        assert read("sweep.png").startswith(b"\x89PNG") and len(read("sweep.png")) > 1000
        for r in rows:  # each trial's run directory, and Tune's own storage, in the bucket too
            assert len(read(f"trials/{r['name']}/metrics.jsonl").splitlines()) == 3
            assert json.loads(read(f"trials/{r['name']}/summary.json"))["steps"] == 3
        tune = fs.get_file_info(pafs.FileSelector("bucket/sweep/tune/sweep", recursive=True))
        assert any(i.base_name.startswith("experiment_state") for i in tune), [i.path for i in tune]
    assert list(tmp_path.iterdir()) == [], "the sweep wrote into the working directory"
    assert len(rows) == 2
    assert len({(r["dp"], r["tp"], r["pp"], r["schedule"], r["zero"]) for r in rows}) == 2
    for r in rows:
        assert not r["failed"], r
        assert r["measured_tokens_per_s"] > 0 and r["param_bytes"] > 0
    shown = done.stdout  # progress without a terminal: one line per finished trial
    assert [line.split()[1] for line in shown.splitlines() if line.startswith("sweep ")] == ["1/2", "2/2"]
    assert "tokens/s" in shown and "results in s3://bucket/sweep" in shown


def test_failed_trial_is_recorded_and_the_sweep_goes_on(ray_local, tmp_path):
    cfg = load_config(
        None,
        ["model.num_layers=2", "model.seq_len=64", "train.global_batch_size=8", f"data.path={tmp_path / 'missing'}"],
    )
    rows = sweep(cfg, 2, PROFILES["h100"], top=2, steps=2, out_dir=tmp_path / "out")
    assert len(rows) == 2
    assert all(r["failed"] and "data.path" in r["reason"] for r in rows), rows
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())[0]["failed"] is True
