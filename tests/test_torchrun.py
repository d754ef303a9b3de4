"""`torchrun --nproc-per-node N -m raytrain_hybrid.cli train`: a run without Ray (launch.runtime.torchrun).

Two ranks at pp=2 on Parquet files of token ids, read in the leaders' processes
(data.local_rows): the run directory's files as under Ray, the losses of the single-process
reference on the same rows, and a resume from its first checkpoint that continues the run
exactly. One torchrun process of ~5 s of CPU per rank and launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

TORCHRUN = Path(sys.executable).parent / "torchrun"
LAYOUT = (
    "model.num_layers=2",
    "train.global_batch_size=8",
    "train.steps=4",
    "parallelism.dp=1",
    "parallelism.tp=1",
    "parallelism.pp=2",
    "checkpoint.interval=2",
    "data.shuffle_buffer=8",
)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """60 documents of 20-200 token ids, about two epochs of the run, in three Parquet files
    written out of their names' order (the rows are read in path order, as Ray Data reads them)."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(20, 200, 60)]
    path = tmp_path_factory.mktemp("torchrun") / "tokens"
    path.mkdir()
    for i, name in ((2, "c"), (0, "a"), (1, "b")):
        part = pa.array(docs[i * 20 : (i + 1) * 20], type=pa.list_(pa.int32()))
        pq.write_table(pa.table({"input_ids": part}), path / f"{name}.parquet")
    return path


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "-m", "raytrain_hybrid.cli", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=300)


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def reference(overrides: tuple[str, ...], parquet: Path, monkeypatch) -> list[dict]:
    """The single-process reference on the file's rows: its own windows and shuffle
    (tests/reference.py), the rows read with pyarrow instead of Ray Data."""
    import reference as ref
    import torch

    from raytrain_hybrid.config import load_config

    table = pa.concat_tables(pq.read_table(p) for p in sorted(parquet.glob("*.parquet")))
    monkeypatch.setattr(ref, "_ray_documents", lambda cfg, size, fmt: table.to_batches(max_chunksize=size))
    torch.manual_seed(0)
    cfg = load_config(None, list(overrides))
    return ref.reference_run(cfg, ref.ray_data_batches(cfg, cfg.train.steps))


def test_torchrun_trains_writes_the_run_directory_and_resumes(tokens, tmp_path, monkeypatch):
    overrides = (*LAYOUT, f"data.path={tokens}")
    first = tmp_path / "run"
    done = torchrun(2, *sets(*overrides, f"run.output_dir={first}"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "start: dp=1 tp=1 pp=2, 2 torchrun processes" in out
    assert "step 4/4" in out and "checkpoint: 2 steps" in out
    assert "done: 4 steps, final loss" in out and "Traceback" not in done.stderr
    for name in ("metrics.jsonl", "summary.json", "config.json", "checkpoints/step_2", "checkpoints/step_4"):
        assert (first / name).exists(), name
    summary = json.loads((first / "summary.json").read_text())
    assert summary["ended"] == "completed" and summary["steps"] == 4
    assert summary["startup_s"]["total_to_first_step"] > 0
    got = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    want = reference(overrides, tokens, monkeypatch)
    assert [g["step"] for g in got] == [0, 1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)

    # The first checkpoint resumed into another run directory: the same steps 3 and 4.
    second = tmp_path / "resumed"
    done = torchrun(2, *sets(*overrides, f"run.output_dir={second}"), "--resume", str(first / "checkpoints/step_2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resumed from {first / 'checkpoints/step_2'} at step 2" in done.stdout
    again = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert [a["step"] for a in again] == [2, 3]
    for a, g in zip(again, got[2:], strict=True):
        assert a["loss"] == pytest.approx(g["loss"], rel=1e-6)


def test_torchrun_refuses_a_layout_of_another_size(tmp_path):
    done = torchrun(1, *sets(*LAYOUT, "data.path=memory", f"run.output_dir={tmp_path / 'run'}"))
    assert done.returncode != 0  # torchrun's own code is 1 when a rank fails; the rank's is 2
    assert "makes 2 ranks, but torchrun started 1: run torchrun --nproc-per-node 2" in done.stderr
    assert "(exitcode: 2)" in done.stderr
    assert not (tmp_path / "run").exists()


def documented() -> list[tuple[str, list[str]]]:
    """Every torchrun command README.md and docs/ show: (where, its words)."""
    import shlex

    root = Path(__file__).resolve().parents[1]
    found = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if "torchrun " in line and "-m raytrain_hybrid.cli" in line and not line.lstrip().startswith("`"):
                found.append((f"{page.relative_to(root)}:{number}", shlex.split(line.lstrip("$ "))))
    return found


def test_the_documented_torchrun_commands_start_as_many_ranks_as_their_layout_needs():
    from raytrain_hybrid.cli import _parser
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.config.fault_tolerance import replica_groups

    shown = documented()
    assert len(shown) >= 3, shown
    for where, words in shown:
        words = words[words.index("srun") + 1 :] if "srun" in words else words
        assert Path(words[0]).name == "torchrun" and "--standalone" in words, where
        nproc = int(words[words.index("--nproc-per-node") + 1])
        args = _parser().parse_args(words[words.index("raytrain_hybrid.cli") + 1 :])
        assert args.command == "train", where
        # The model and data are the reader's: their layout is what is checked here.
        sets = [o for o in args.overrides if not o.startswith(("model.pretrained=", "data.path="))]
        cfg = load_config(
            args.config, [*sets, "model.pretrained=", "data.path=memory", "data.format=text"], unverified=[]
        )
        par = cfg.parallelism
        # With fault tolerance, each replica group is a launch of its own.
        groups = replica_groups(par) if cfg.fault_tolerance.enabled else 1
        assert par.layout == "fixed" and par.world_size // groups == nproc, where
