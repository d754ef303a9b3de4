"""A run on object storage, entered as a user does: the CLI with run.output_dir=s3://..., against a
real S3 endpoint (moto's server on loopback) found through AWS_ENDPOINT_URL alone.

Everything the run keeps lands in the bucket and nothing in the working directory; --resume from
the bucket under another layout continues with the uninterrupted run's losses; export reads the
bucket; a damaged checkpoint on S3 is refused as on disk; no credential reaches the bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from s3_server import KEY_ID, SECRET, s3_server

CLI = [sys.executable, "-m", "raytrain_hybrid.cli"]
COMMON = [
    "data.path=memory",
    "model.num_layers=4",
    "model.seq_len=32",
    "train.global_batch_size=8",
    "train.steps=4",
    "checkpoint.interval=2",
    "run.progress=false",
]
FIRST = ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=2", "parallelism.microbatches=2"]
OTHER = ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=2"]


def _cli(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _objects(fs: pafs.FileSystem, prefix: str) -> dict[str, bytes]:
    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True))
    out = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                out[info.path.removeprefix(prefix + "/")] = f.read()
    return out


def _losses(metrics: bytes) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, metrics.decode().splitlines())}


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        yield env, pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"])


@pytest.fixture(scope="module")
def first_run(s3, tmp_path_factory):
    _, fs = s3
    cwd = tmp_path_factory.mktemp("cwd")
    done = _cli(["train", *_sets([*COMMON, *FIRST, "run.output_dir=s3://bucket/run"])], cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, cwd, _objects(fs, "bucket/run")


def test_everything_the_run_keeps_is_in_the_bucket(first_run):
    done, cwd, objects = first_run
    assert "newest checkpoint s3://bucket/run/checkpoints/step_4" in done.stdout.splitlines()[-1]
    for name in ("metrics.jsonl", "summary.json", "config.json", "driver.log"):
        assert name in objects, sorted(objects)
    assert any(k.startswith("tensorboard/") for k in objects), sorted(objects)
    for step in (2, 4):
        manifest = json.loads(objects[f"checkpoints/step_{step}/manifest.json"])
        assert manifest["step"] == step
        for name, digest in manifest["files"].items():  # every rank's shards, whole
            assert len(objects[f"checkpoints/step_{step}/{name}"]) == digest["size"]
    assert sorted(_losses(objects["metrics.jsonl"])) == [0, 1, 2, 3]
    assert list(cwd.iterdir()) == [], "the run wrote into the working directory"


def test_no_credential_reaches_the_bucket(first_run):
    _, _, objects = first_run
    for name, data in objects.items():
        assert KEY_ID.encode() not in data and SECRET.encode() not in data, name


def test_resume_from_the_bucket_under_another_layout_continues_the_losses(s3, first_run, tmp_path):
    _, fs = s3
    _, _, objects = first_run
    done = _cli(
        [
            "train",
            "--resume",
            "s3://bucket/run/checkpoints/step_2",
            *_sets([*COMMON, *OTHER, "run.output_dir=s3://bucket/resumed"]),
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before, after = _losses(objects["metrics.jsonl"]), _losses(_objects(fs, "bucket/resumed")["metrics.jsonl"])
    assert sorted(after) == [2, 3]
    for step in (2, 3):
        assert after[step] == pytest.approx(before[step], rel=1e-4), (step, before, after)


def test_export_reads_the_bucket(first_run, tmp_path):
    from transformers import AutoModelForCausalLM

    done = _cli(["export", "s3://bucket/run", str(tmp_path / "hf")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_hidden_layers == 4


def test_a_damaged_checkpoint_on_s3_is_refused(s3, first_run, tmp_path):
    _, fs = s3
    shard = "bucket/run/checkpoints/step_4/__1_0.distcp"
    with fs.open_input_stream(shard) as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the digest can tell
    with fs.open_output_stream(shard) as f:
        f.write(bytes(data))
    done = _cli(
        ["train", "--resume", "s3://bucket/run/checkpoints/step_4", *_sets([*COMMON, "train.steps=6"])], tmp_path
    )
    assert done.returncode == 2
    assert "has a corrupted __1_0.distcp" in done.stderr, done.stderr[-2000:]
