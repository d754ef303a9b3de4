"""A symlink planted at a directory inside the run directory (profile/, checkpoints/, a
checkpoints/step_<N>/, hang/, compile_cache/, tensorboard/) is refused, naming it, by what the run
writes, makes or deletes there: nothing goes through it, and its target is left as it was. A real
directory at the same name works (the negative control). The run directory itself may be a link.
Each case calls the function the run calls, in this process (no Ray, no training)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import open_store


def _plant(run: Path, name: str, tmp_path: Path) -> Path:
    """``run/name`` a link to a directory elsewhere holding a sentinel file (and one at the name
    the run would write); the target returned."""
    target = tmp_path / f"target_{name.replace('/', '_')}"
    target.mkdir()
    (target / "sentinel").write_text("precious\n")
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).symlink_to(target, target_is_directory=True)
    return target


def _files(target: Path) -> dict[str, bytes]:
    return {str(p.relative_to(target)): p.read_bytes() for p in sorted(target.rglob("*")) if p.is_file()}


def _refused(run: Path, name: str):
    """pytest.raises for the refusal of the link at ``run/name`` (a save's comes within the
    CheckpointSaveError that fails the run, when it is found as the save completes)."""
    from raytrain_hybrid.checkpoint.save import CheckpointSaveError

    return pytest.raises(
        (ConfigError, CheckpointSaveError), match=f"{run / name} is a symbolic link .*does not follow links inside"
    )


def _write_trace(run: Path) -> None:
    """StepProfiler._write_trace, as the profiler's schedule calls it, with a stand-in trace."""
    from raytrain_hybrid.engine.profile import PROFILE_DIR, StepProfiler

    profiler = StepProfiler.__new__(StepProfiler)  # (its __init__ reads a trainer)
    profiler.store, profiler.rank, profiler.written = open_store(str(run)).child(PROFILE_DIR), 0, False

    class Prof:
        def export_chrome_trace(self, path: str) -> None:
            Path(path).write_text('{"traceEvents": []}')

    profiler._write_trace(Prof())


def _gather_dumps(run: Path, tmp_path: Path, monkeypatch) -> None:
    """hang.gather_nccl_dumps: a node's NCCL dump copied to hang/nccl/."""
    from raytrain_hybrid.engine import hang

    local = tmp_path / "node" / "trace_"
    local.parent.mkdir(exist_ok=True)
    (local.parent / "trace_0").write_bytes(b"record")
    os.utime(local.parent / "trace_0", (0, 0))
    environ = {k: v for k, v in os.environ.items() if k not in hang.DUMP_PREFIX_VARS}
    monkeypatch.setattr(os, "environ", {**environ, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(local)})
    hang.gather_nccl_dumps(open_store(str(run)).child(hang.HANG_DIR))


def _archive_cache(run: Path, tmp_path: Path) -> None:
    """CompileCache.after_step after the first step that compiled: rank0.tar in compile_cache/."""
    from raytrain_hybrid.engine.compile_cache import CACHE_DIR, CompileCache

    local = tmp_path / "inductor"
    local.mkdir(exist_ok=True)
    (local / "entry").write_bytes(b"graph")
    CompileCache(open_store(str(run)).child(CACHE_DIR), 0, str(local)).after_step({"compiles": 1})


def _tensorboard(run: Path) -> None:
    """RunLog with TensorBoard on: its event files under tensorboard/."""
    from raytrain_hybrid.launch.records.progress import RunLog

    log = RunLog(run, steps=2, progress=False, tensorboard=True)
    log.tb.close()
    log.file.close()


WRITERS = {
    "profile": (lambda run, tmp_path, mp: _write_trace(run), "profile/trace_rank0.json"),
    "hang": (_gather_dumps, "hang/nccl/trace_0"),
    "hang/nccl": (_gather_dumps, "hang/nccl/trace_0"),
    "compile_cache": (lambda run, tmp_path, mp: _archive_cache(run, tmp_path), "compile_cache/rank0.tar"),
    "tensorboard": (lambda run, tmp_path, mp: _tensorboard(run), "tensorboard"),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_link_planted_at_a_directory_the_run_writes_into_is_refused(tmp_path, monkeypatch, name):
    write, written = WRITERS[name]
    run = tmp_path / "run"
    run.mkdir()
    target = _plant(run, name, tmp_path)
    before = _files(target)
    with _refused(run, name):
        write(run, tmp_path, monkeypatch)
    assert _files(target) == before and (run / name).is_symlink()


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_real_directory_there_is_written_into(tmp_path, monkeypatch, name):
    write, written = WRITERS[name]
    run = tmp_path / "run"
    (run / name).mkdir(parents=True)
    write(run, tmp_path, monkeypatch)
    assert (run / written).exists(), sorted(p.name for p in (run / name).iterdir())


def test_the_run_directory_itself_may_be_a_link(tmp_path):
    """Where run.output_dir points is the user's choice: only what is below it is checked."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "run").symlink_to(real, target_is_directory=True)
    _write_trace(tmp_path / "run")
    assert (real / "profile" / "trace_rank0.json").is_file()


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture
def one_process_group(tmp_path):
    """A world of one gloo process, in this process (the writer's barriers and gathers)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _save(run: Path, step: int, monkeypatch) -> None:
    """CheckpointWriter.save of step ``step`` in the foreground, of a stand-in training state."""
    import torch

    from raytrain_hybrid.checkpoint import save

    monkeypatch.setattr(save, "training_state", lambda *a, **k: ({"w": torch.arange(4.0)}, None))
    cfg = load_config(None, [f"run.output_dir={run}", "checkpoint.async_save=false"])
    writer = save.CheckpointWriter(cfg, "launch", trajectory={"stand-in": True})
    writer.save(None, step)
    writer.close()


@pytest.mark.parametrize("name", ["checkpoints", "checkpoints/step_1.partial", "checkpoints/step_1"])
def test_a_save_through_a_planted_link_is_refused(tmp_path, monkeypatch, one_process_group, name):
    run = tmp_path / "run"
    run.mkdir()
    target = _plant(run, name, tmp_path)
    before = _files(target)
    with _refused(run, name):
        _save(run, 1, monkeypatch)
    assert _files(target) == before and (run / name).is_symlink()


def test_a_save_into_a_real_checkpoints_directory_completes(tmp_path, monkeypatch, one_process_group):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    _save(run, 1, monkeypatch)
    assert json.loads((run / "checkpoints" / "step_1" / "manifest.json").read_text())["step"] == 1


def _prunable(root: Path, link: str | None, tmp_path: Path) -> Path | None:
    """checkpoints/ with complete step_1 and step_2 (``link``: that one a link to a directory
    elsewhere holding it), and Ray's record of none: prune_earlier removes step_1 with keep=1."""
    root.mkdir(parents=True, exist_ok=True)
    target = None
    for step in (1, 2):
        where = root / f"step_{step}"
        if link == where.name:
            target = _plant(root, where.name, tmp_path)
            where = target
        where.mkdir(exist_ok=True)
        (where / "manifest.json").write_text(json.dumps({"step": step}))
    (root / "checkpoint_manager_snapshot.json").write_text(json.dumps({"checkpoint_results": []}))
    return target


@pytest.mark.parametrize("name", ["checkpoints", "checkpoints/step_1"])
def test_pruning_an_earlier_step_through_a_planted_link_is_refused(tmp_path, name):
    from raytrain_hybrid.launch.runtime.driver import prune_earlier

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, [f"run.output_dir={run}", "checkpoint.keep=1"])
    if name == "checkpoints":
        target = _plant(run, name, tmp_path)
        _prunable(target, None, tmp_path)
    else:
        target = _prunable(run / "checkpoints", "step_1", tmp_path)
    before = _files(target)
    with _refused(run, name):
        prune_earlier(cfg)
    assert _files(target) == before and (run / name).is_symlink()


def test_pruning_a_real_earlier_step_removes_it(tmp_path):
    from raytrain_hybrid.launch.runtime.driver import prune_earlier

    run = tmp_path / "run"
    _prunable(run / "checkpoints", None, tmp_path)
    cfg = load_config(None, [f"run.output_dir={run}", "checkpoint.keep=1"])
    assert prune_earlier(cfg) == ["step_1"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint_manager_snapshot.json", "step_2"]


def test_a_link_inside_a_step_being_pruned_is_removed_not_followed(tmp_path):
    """rmtree by descriptor: a link inside the step directory goes, its target's files stay."""
    from raytrain_hybrid.launch.runtime.driver import prune_earlier

    run = tmp_path / "run"
    _prunable(run / "checkpoints", None, tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "sentinel").write_text("precious\n")
    (run / "checkpoints" / "step_1" / "inside").symlink_to(target, target_is_directory=True)
    assert prune_earlier(load_config(None, [f"run.output_dir={run}", "checkpoint.keep=1"])) == ["step_1"]
    assert (target / "sentinel").read_text() == "precious\n"
