"""A run on object storage, entered as a user does: the CLI with run.output_dir=s3://..., against a
real S3 endpoint (moto's server on loopback) found through AWS_ENDPOINT_URL alone.

prepare-data writes its shards straight into the bucket and a run reads them from there.
Everything a run keeps lands in the bucket and nothing in the working directory, the driver's
files at every checkpoint (the bucket keeps every version of an object); --resume from the bucket
under another layout continues with the uninterrupted run's losses; export reads the bucket; a
damaged checkpoint on S3 is refused as on disk; no credential reaches the bucket, in any version.
The run (one replica of two pipeline stages) and its resume are held to the single-process
reference on the same Ray Data input (tests/reference.py): every step's loss, gradient norm and
learning rate, and the exported final weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from conftest import reference_history
from s3_server import KEY_ID, SECRET, s3_server
from test_oracle import RTOL, _noise_only

from raytrain_hybrid.data.corpus import DEFAULT_CORPUS

CLI = [sys.executable, "-m", "raytrain_hybrid.cli"]
COMMON = [
    "data.path=s3://bucket/prep",  # what prepare-data wrote (the `prepared` fixture)
    "model.num_layers=4",
    "model.seq_len=32",
    "train.global_batch_size=8",
    "train.steps=4",
    "checkpoint.interval=2",
    "run.progress=false",
]
# Two workers (a Ray Train worker's start is ~10 s of the suite's CPU): one replica of two stages.
FIRST = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2", "parallelism.microbatches=2"]
# The resume: parallelism.layout=auto with dp at most 2, on the session's cluster (one node of 16
# logical CPUs, one worker each): the planner's CPU profile (this machine's cores shared by the
# ranks) picks two replicas of one rank, not the first run's (1,1,2): the checkpoint resharded from
# two pipeline stages to two data-parallel replicas, and Ray Data's read split in two.
OTHER = ["parallelism.layout=auto", "parallelism.dp=2"]


def _cli(args: list[str], cwd: Path, s3, timeout: int = 600) -> subprocess.CompletedProcess:
    # The session's cluster, through RAY_ADDRESS as a user with a running cluster: it started
    # with the bucket's endpoint and keys in its environment (tests/conftest.py), as a cloud
    # cluster's nodes have theirs. A Ray of its own per command cost the suite a start each.
    env = {**os.environ, "RAY_ADDRESS": s3[0]["RAY_ADDRESS"]}
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


def _assert_reference(metrics: bytes, reference: list[dict], steps: list[int]) -> None:
    """Each of ``steps`` in a run's metrics.jsonl has the single-process reference's loss and gradient
    norm (RTOL, as every Ray run is held) and learning rate."""
    rows = {m["step"]: m for m in map(json.loads, metrics.decode().splitlines())}
    assert sorted(rows) == steps and len(reference) == 4
    for step in steps:
        got, want = rows[step], reference[step]
        for key, rtol in (("loss", RTOL), ("grad_norm", RTOL), ("lr", 1e-9)):
            assert got[key] == pytest.approx(want[key], rel=rtol), (key, step, got[key], want[key])


def _versions(s3, key: str) -> list[bytes]:
    """Every version of ``key`` (or of each object under a prefix ending in "/") the bucket kept."""
    env, _ = s3
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
    out = []
    for page in client.get_paginator("list_object_versions").paginate(Bucket="bucket", Prefix=key):
        for v in page.get("Versions", []):
            # Under a prefix: its objects, not the empty marker pyarrow puts for the "directory".
            if (v["Key"] != key) if key.endswith("/") else (v["Key"] == key):
                body = client.get_object(Bucket="bucket", Key=v["Key"], VersionId=v["VersionId"])["Body"]
                out.append(body.read())
    return out


@pytest.fixture(scope="module")
def s3(ray_local):
    with s3_server() as env:
        env = {**env, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
        import boto3

        # Every upload kept: what reached the bucket mid-run stays visible after the run.
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).put_bucket_versioning(
            Bucket="bucket", VersioningConfiguration={"Status": "Enabled"}
        )
        yield env, pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"])


@pytest.fixture(scope="module")
def prepared(s3, tmp_path_factory):
    """prepare-data from a local text file straight into the bucket, as a cluster's input is made."""
    source = tmp_path_factory.mktemp("source") / "docs.txt"
    source.write_text(DEFAULT_CORPUS.read_text()[:20000])  # a few thousand tokens: 4 steps need ~1000
    cwd = tmp_path_factory.mktemp("prepare_cwd")
    done = _cli(["prepare-data", str(source), "s3://bucket/prep"], cwd, s3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, cwd


def test_prepare_data_writes_its_shards_into_the_bucket(s3, prepared):
    _, fs = s3
    done, cwd = prepared
    objects = _objects(fs, "bucket/prep")
    marker = json.loads(objects.pop("_SUCCESS"))  # written last: the output is whole
    assert objects and all(name.endswith(".parquet") for name in objects), sorted(objects)
    tables = [pq.read_table(pa.BufferReader(data)) for data in objects.values()]
    tokens = sum(sum(t.column("num_tokens").to_pylist()) for t in tables)
    assert marker == {"rows": sum(t.num_rows for t in tables), "tokens": tokens, "files": sorted(objects)}
    said, log = done.stdout.strip().split(" (Ray's output: ")
    assert said == f"wrote {tokens:,} tokens to s3://bucket/prep"
    # As quiet as `train`: Ray's notices and Ray Data's progress in a log file, not on the terminal.
    assert "Ray" not in done.stderr and "Dataset" in Path(log.rstrip(")")).read_text(), done.stderr[-2000:]
    assert tables[0].schema.field("input_ids").type == pa.list_(pa.int32())
    assert list(cwd.iterdir()) == [], "prepare-data wrote into the working directory"


@pytest.fixture(scope="module")
def first_run(s3, prepared, tmp_path_factory):
    """A run on the prepared data in the bucket (data.path=s3://...: the input check before workers
    start, Ray Data's reads and the replica leaders' streams all read the bucket), its output
    there too. The single-process reference on the same Ray Data input is computed meanwhile (the
    run mostly waits on its workers)."""
    _, fs = s3
    cwd = tmp_path_factory.mktemp("cwd")
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(reference_history, tuple(COMMON), "ray")
        done = _cli(["train", *_sets([*COMMON, *FIRST, "run.output_dir=s3://bucket/run"])], cwd, s3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, cwd, _objects(fs, "bucket/run"), reference.result()


def test_the_pipeline_run_on_the_bucket_trains_as_the_single_process_reference(first_run):
    """(1,1,2) through Ray Train, reading Ray Data's shards of the bucket: every step as one process."""
    _, _, objects, reference = first_run
    _assert_reference(objects["metrics.jsonl"], reference, [0, 1, 2, 3])


def test_everything_the_run_keeps_is_in_the_bucket(first_run):
    done, cwd, objects, _ = first_run
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
    assert json.loads(objects["config.json"])["data"]["path"] == "s3://bucket/prep"
    assert list(cwd.iterdir()) == [], "the run wrote into the working directory"


def test_the_driver_files_reach_the_bucket_at_every_checkpoint(s3, first_run):
    """Not only at the end: the driver uploads its files whenever a checkpoint completes (two
    here) and at the end, every file each time (tests/test_storage.py shows one such upload
    mid-run); summary.json exists only at the end."""
    _, _, objects, _ = first_run
    checkpoints = len(json.loads(objects["summary.json"])["checkpoints"])
    uploads = len(_versions(s3, "run/metrics.jsonl"))
    assert checkpoints == 2 and uploads > checkpoints
    for name in ("run/driver.log", "run/config.json", "run/tensorboard/"):
        assert len(_versions(s3, name)) == uploads, name  # uploaded together with metrics.jsonl
    assert len(_versions(s3, "run/summary.json")) < uploads


def test_no_credential_reaches_the_bucket(s3, first_run):
    for data in _versions(s3, "run/"):  # every object, every version the bucket kept
        assert KEY_ID.encode() not in data and SECRET.encode() not in data


def test_resume_from_the_bucket_under_another_layout_continues_the_losses(s3, first_run, tmp_path):
    """Another layout, the one the planner picks for the cluster (two replicas where the first run
    had one of two stages; another placement group, so Ray Data cuts the read into other blocks):
    the same documents, the single-process reference's steps. The run
    prints its pick and the runner-up; summary.json has the layout it ran."""
    _, fs = s3
    _, _, objects, reference = first_run
    done = _cli(
        [
            "train",
            "--resume",
            "s3://bucket/run/checkpoints/step_2",
            *_sets([*COMMON, *OTHER, "run.output_dir=s3://bucket/resumed"]),
        ],
        tmp_path,
        s3,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pick = "layout auto: dp=2 tp=1 pp=1 1F1B microbatches=1 zero=0 activation_checkpointing=false on nodes holding [15]"
    assert pick in done.stdout and "layout auto: runner-up dp=1" in done.stdout, done.stdout
    resumed = _objects(fs, "bucket/resumed")
    layout = json.loads(resumed["summary.json"])["layout"]
    assert (layout["dp"], layout["tp"], layout["pp"], layout["microbatches"]) == (2, 1, 1, 1), layout
    before, after = _losses(objects["metrics.jsonl"]), _losses(resumed["metrics.jsonl"])
    assert sorted(after) == [2, 3]
    for step in (2, 3):
        assert after[step] == pytest.approx(before[step], rel=1e-4), (step, before, after)
    _assert_reference(resumed["metrics.jsonl"], reference, [2, 3])


def test_export_reads_the_bucket(s3, first_run, tmp_path):
    """The run's last checkpoint, exported from the bucket, holds the reference's final weights."""
    from transformers import AutoModelForCausalLM

    reference = first_run[3]
    done = _cli(["export", "s3://bucket/run", str(tmp_path / "hf")], tmp_path, s3)
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_hidden_layers == 4
    params, want = dict(model.named_parameters()), reference[-1]["params"]
    assert sorted(params) == sorted(want)
    noise = _noise_only(reference)  # a zero gradient but for rounding: AdamW's steps are noise
    for name, w in want.items():
        if name not in noise:
            diff = float((params[name].detach() - w).norm() / w.norm().clamp_min(1e-12))
            assert diff <= RTOL, f"final value of {name} differs by {diff:.2e} of its norm"


def test_a_damaged_checkpoint_on_s3_is_refused(s3, first_run, tmp_path):
    _, fs = s3
    shard = "bucket/run/checkpoints/step_4/__1_0.distcp"
    with fs.open_input_stream(shard) as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the digest can tell
    with fs.open_output_stream(shard) as f:
        f.write(bytes(data))
    done = _cli(
        ["train", "--resume", "s3://bucket/run/checkpoints/step_4", *_sets([*COMMON, "train.steps=6"])], tmp_path, s3
    )
    assert done.returncode == 2
    assert "has a corrupted __1_0.distcp" in done.stderr, done.stderr[-2000:]
