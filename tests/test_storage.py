"""The storage layer on a real S3 endpoint (moto's server on loopback) and on local disk:
the same calls, the same results, the endpoint and keys from the environment only."""

from __future__ import annotations

import pytest
import torch
from s3_server import s3_server

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import is_uri, open_store


@pytest.fixture(scope="module")
def s3():
    with s3_server() as env:
        yield env


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "run"))
    request.getfixturevalue("s3")
    return open_store(f"s3://bucket/{tmp_path.name}/run")


def test_the_same_calls_work_on_disk_and_on_s3(root, tmp_path):
    assert not root.exists() and root.listdir() == []
    root.child("metrics.jsonl").write_text('{"step": 1}\n')
    root.child("checkpoints", "step_2", "manifest.json").write_text("{}")
    assert root.is_dir() and root.listdir() == ["checkpoints", "metrics.jsonl"]
    assert root.child("metrics.jsonl").read_text() == '{"step": 1}\n'
    assert root.child("metrics.jsonl").size() == len('{"step": 1}\n')
    assert root.child("checkpoints").listdir() == ["step_2"]

    local = tmp_path / "shards"
    local.mkdir()
    (local / "__0_0.distcp").write_bytes(b"\x00" * 1000)
    (local / ".metadata").write_bytes(b"meta")
    step = root.child("checkpoints", "step_4")
    step.upload(str(local))
    assert step.listdir() == [".metadata", "__0_0.distcp"]
    step.download(str(tmp_path / "back"))
    assert (tmp_path / "back" / "__0_0.distcp").read_bytes() == b"\x00" * 1000

    step.delete()
    assert root.child("checkpoints").listdir() == ["step_2"]
    step.delete()  # gone already: nothing to do


def test_uris_keep_their_scheme_and_local_paths_become_absolute(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = open_store("runs/latest")
    assert local.local and local.uri == str(tmp_path / "runs" / "latest")
    remote = open_store("s3://bucket/a/b/")
    assert not remote.local and remote.uri == "s3://bucket/a/b" and remote.path == "bucket/a/b"
    assert (
        remote.child("c", "d").uri == "s3://bucket/a/b/c/d"
        and remote.child("c").parent.uri == remote.uri
        and str(remote) == remote.uri
    )
    assert is_uri("gs://b/x") and not is_uri("/mnt/shared/x")


def test_a_location_pyarrow_cannot_open_names_the_key():
    with pytest.raises(ConfigError, match="run.output_dir.*nosuchscheme://"):
        open_store("nosuchscheme://x/y")
    with pytest.raises(ConfigError, match="--resume"):
        open_store("", key="--resume")


def test_a_local_output_dir_is_refused_where_workers_cannot_share_the_disk(s3, tmp_path):
    """Refused before workers start on several nodes, or when the only node holds no worker (an
    autoscaler's head); a mount declared shared, or an object-store URI, passes."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.plan.preflight import _check_output_dir

    worker = {"CPU": 1.0}
    one, head_only, two = [{"CPU": 8.0}], [{"CPU": 0.0}], [{"CPU": 8.0}, {"CPU": 8.0}]
    local = load_config(None, [f"run.output_dir={tmp_path}"])
    _check_output_dir(local, one, worker)
    for nodes, where in ((two, "the cluster has 2 nodes"), (head_only, "nodes still to come")):
        with pytest.raises(ConfigError, match=where) as refused:
            _check_output_dir(local, nodes, worker)
        assert "run.shared_fs=true" in str(refused.value) and "s3://" in str(refused.value)
    _check_output_dir(load_config(None, [f"run.output_dir={tmp_path}", "run.shared_fs=true"]), two, worker)
    _check_output_dir(load_config(None, ["run.output_dir=s3://bucket/run"]), two, worker)


def test_a_save_cut_short_on_s3_is_passed_over_and_does_not_block_the_resume(s3, tmp_path):
    """A killed job or a lost node can leave step_<N>/ on object storage with shards but no
    manifest (no rename there): --resume of the run takes the newest complete checkpoint, keeps
    the steps before it from metrics.jsonl, and the unfinished step_<N> is no reason to refuse
    (the next save of step N replaces it)."""
    import json

    from raytrain_hybrid.checkpoint.manifest import FORMAT, layout_of
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.runtime.start import check_resume

    run = f"s3://bucket/{tmp_path.name}/cut"
    cfg = load_config(None, ["train.steps=6", f"run.output_dir={run}"])
    root = open_store(run)
    from fuzz_files import training_state

    files = _dcp_files(tmp_path / "dcp", training_state(cfg))
    manifest = {"format": FORMAT, "step": 2, "launch_id": "a", "world_size": 1, "layout": layout_of(cfg),
                "config": cfg.to_dict(), "data_position": {}, "files": files}  # fmt: skip
    root.child("checkpoints", "step_2").upload(str(tmp_path / "dcp"))
    root.child("checkpoints", "step_2", "manifest.json").write_text(json.dumps(manifest))
    root.child("checkpoints", "step_4", "__0_0.distcp").write_bytes(b"shard")  # the save that was cut short
    root.child("metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(3)))
    point = check_resume(cfg, run)
    path, history = point.path, point.history
    assert path == f"{run}/checkpoints/step_2" and [h["step"] for h in history] == [0, 1]
    root.child("checkpoints", "step_4").upload(str(tmp_path / "dcp"))
    root.child("checkpoints", "step_4", "manifest.json").write_text(json.dumps({**manifest, "step": 4}))
    with pytest.raises(ConfigError, match="would overwrite the later step_4"):  # a complete one is kept
        check_resume(cfg, f"{run}/checkpoints/step_2")


def test_the_driver_files_reach_the_uri_when_a_checkpoint_completes(s3, tmp_path):
    """The driver's RunLog and RunDir as a run uses them: when a checkpoint is heard of, what the
    steps before it wrote (metrics.jsonl, TensorBoard events, config.json, the driver's log as it
    stands) is in the bucket already, before the run ends."""
    import functools
    import json
    import shutil

    from raytrain_hybrid.launch.records.events import CheckpointEvent, StepEvent
    from raytrain_hybrid.launch.records.progress import RunLog
    from raytrain_hybrid.launch.records.rundir import RunDir

    uri = f"s3://bucket/{tmp_path.name}/run"
    run_dir = RunDir.open(uri)
    (run_dir.local / "config.json").write_text("{}\n")
    live = tmp_path / "driver.log"  # quiet_driver's log, still being written
    live.write_text("Started a local Ray instance.\n")
    log = RunLog(run_dir.local, steps=4, progress=False, on_checkpoint=functools.partial(run_dir.sync, live))
    try:
        for step in (0, 1):
            log.handle(StepEvent({"step": step, "loss": 9.0 - step, "grad_norm": 1.0, "tokens_per_s": 1e3}))
        log.handle(CheckpointEvent(2, f"{uri}/checkpoints/step_2", write_s=0.1, save_s=0.1, blocked_s=0.0))
        root = open_store(uri)
        steps = [json.loads(line)["step"] for line in root.child("metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1]
        assert root.child("driver.log").read_text() == "Started a local Ray instance.\n"
        assert root.child("config.json").read_text() == "{}\n"
        (events,) = root.child("tensorboard").listdir()
        assert b"train/loss" in root.child("tensorboard", events).read_bytes()  # flushed, not only buffered
    finally:
        log.close()
        shutil.rmtree(run_dir.local)


def _dcp_files(directory, state: dict) -> dict:
    """A real DCP checkpoint of ``state`` in ``directory`` (one process); its manifest's files."""
    import torch.distributed.checkpoint as dcp

    from raytrain_hybrid.checkpoint.manifest import file_digest

    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return {p.name: file_digest(p) for p in directory.iterdir()}


def test_a_checkpoint_on_s3_is_read_by_byte_range_not_copied(s3, tmp_path):
    """A rank loading from object storage reads the byte ranges of the entries it loads, straight
    from the bucket: nothing is copied to the node's disk, and a checkpoint rewritten at the same
    URI (a run continuing in place) is read as it is now."""
    from raytrain_hybrid.checkpoint.reader import safe_load

    step = open_store(f"s3://bucket/{tmp_path.name}/checkpoints/step_2")
    for version in (1.0, 2.0):
        local = tmp_path / f"v{version}"
        state = {f"w{i}": torch.full((256, 256), version + i) for i in range(8)}
        _dcp_files(local, state)
        step.delete()
        step.upload(str(local))
        want = {"w3": torch.zeros(256, 256)}
        reader = safe_load(want, step.uri, no_dist=True)
        assert torch.equal(want["w3"], state["w3"]), version
        total = sum(p.stat().st_size for p in local.iterdir())
        metadata = (local / ".metadata").stat().st_size
        # One entry of eight, and the metadata: about an eighth of the shard, not the file.
        assert reader.bytes_read < metadata + 1.1 * (total - metadata) / 8, (reader.bytes_read, total)


def test_keep_prunes_what_an_earlier_launch_left_and_leaves_rays_own(root):
    """A run killed and resumed in place: Ray Train prunes only what it registered; the end of
    the run removes the earlier launch's checkpoints beyond checkpoint.keep and a save cut short
    before the newest, and never one Ray's record lists (Ray deletes those itself)."""
    import json

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.runtime.driver import prune_earlier

    ckpts = root.child("checkpoints")
    for step in (1, 3, 4, 5, 6):
        ckpts.child(f"step_{step}", "manifest.json").write_text("{}")
    ckpts.child("step_2", "__0_0.distcp").write_bytes(b"cut short")  # no manifest
    record = {"checkpoint_results": [{"checkpoint_dir_name": n} for n in ("step_3", "step_6")]}
    ckpts.child("checkpoint_manager_snapshot.json").write_text(json.dumps(record))
    cfg = load_config(None, [f"run.output_dir={root.uri}", "checkpoint.keep=2"])
    assert prune_earlier(cfg) == ["step_1", "step_2", "step_4"]
    assert [n for n in ckpts.listdir() if n.startswith("step_")] == ["step_3", "step_5", "step_6"]
    assert prune_earlier(load_config(None, [f"run.output_dir={root.uri}", "checkpoint.keep=0"])) == []
