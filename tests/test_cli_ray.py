"""The `train` command as a user types it, on raw-text Parquet it has never seen.

A directory of Parquet files written with plain pyarrow, prose in a string column that is
not called "text" (docstrings of the Python standard library, not the shipped corpus), and
only ``data.path`` and ``data.text_column`` set: Ray Data tokenizes it. The run at (2,1,1)
must give the per-step losses of the single-process reference loop on the same Ray Data
batches, and the terminal must show the run (step lines, the result) and nothing of Ray's
start-up chatter. (A CLI run at (1,1,1) was dropped from here: it repeated the reference.)
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import reference_history

MODULES = ["json", "csv", "argparse", "logging", "pathlib", "subprocess", "threading", "collections", "functools"]
MODULES += ["itertools", "typing", "dataclasses", "inspect", "textwrap", "shutil", "tempfile", "unittest", "email"]
COMMON = ("train.steps=3", "model.num_layers=2", "train.global_batch_size=8")


@pytest.fixture(scope="module")
def raw_text_dir(tmp_path_factory) -> Path:
    """~1,000 paragraphs (~40k tokens): more than an epoch of the run, so Ray Data reads once."""
    docs = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for obj in [mod, *(getattr(mod, a) for a in dir(mod) if not a.startswith("_"))]:
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
                docs += [p.strip() for p in (inspect.getdoc(obj) or "").split("\n\n") if len(p.strip()) > 40]
    docs = list(dict.fromkeys(docs))
    out = tmp_path_factory.mktemp("rawtext")
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        table = pa.table({"doc_id": list(range(len(part))), "body": part})
        pq.write_table(table, out / f"part-{i:03d}.parquet")
    return out


def _train(ray_local, data: Path, out: Path, layout: list[str], env: dict | None = None) -> subprocess.Popen:
    address = ray_local.get_runtime_context().gcs_address  # the session's cluster: no second start
    sets = [*COMMON, *layout, f"data.path={data}", "data.text_column=body", f"run.output_dir={out}"]
    sets.append("run.max_failures=0")
    sets.append(f"cluster.address={address}")
    exe = Path(sys.executable).parent / "raytrain-hybrid"
    argv = [str(exe), "train", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, **(env or {})}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


# dp (Ray Data's shards) over two Ray Train workers, each accumulating 2 micro-batches (a
# worker's start is ~9 s of the suite's CPU). Tensor parallelism through Ray Train on Ray Data
# (the replica's leader shares its batch with its TP peer) is the submitted jobs' resume at
# (1,2,2) on the shipped corpus (tests/test_jobs_ray.py); 2x2x2 on 8 workers is the quick start
# notebook's run (tests/test_notebooks.py), the CLI's own default layout.
LAYOUT = ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=2"]


# The 2x1x1 run is also tracked in MLflow from rank 0 (a local file store, the environment a
# user sets), with a checkpoint at its end. The token is a stand-in credential: nothing keeps it.
FAKE_TOKEN = "mlflow-token-that-must-not-be-kept"
TRACKED = ["run.tracking=mlflow", "checkpoint.interval=3"]


@pytest.fixture(scope="module")
def raw_text_runs(ray_local, raw_text_dir, multimodal_run, tmp_path_factory):
    """The 2x1x1 run (3 of the session's 16 CPUs; the multimodal run of the last test, started
    first, takes 3 more), and the reference meanwhile: much of a run's start-up is waiting,
    which the others fill. -> (directory, reference, {name: (proc, out, err)})"""
    tmp_path = tmp_path_factory.mktemp("raw_text_runs")
    mlflow_env = {
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
        "MLFLOW_EXPERIMENT_NAME": "cli",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 refuses a file store without it
        "MLFLOW_TRACKING_TOKEN": FAKE_TOKEN,
    }
    procs = {"2x1x1": _train(ray_local, raw_text_dir, tmp_path / "2x1x1", [*LAYOUT, *TRACKED], mlflow_env)}
    try:
        reference = reference_history((*COMMON, f"data.path={raw_text_dir}", "data.text_column=body"), "ray")
        done = {name: (proc, *proc.communicate(timeout=600)) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    return tmp_path, reference, done


def test_raw_text_parquet_trains_at_2x1x1_as_the_single_process_reference_and_the_terminal_is_quiet(raw_text_runs):
    tmp_path, reference, done = raw_text_runs
    runs = {}
    for name, (proc, stdout, stderr) in done.items():
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
        lines = stdout.splitlines()
        # What the user sees: one line per step and the result; Ray's output is in driver.log.
        assert [ln.split()[1] for ln in lines if ln.startswith("step ")] == ["1/3", "2/3", "3/3"]
        assert lines[-1].startswith("done: 3 steps"), lines
        assert lines[0].startswith("start: dp=2 tp=1 pp=1, 2 workers (1 CPU each)"), lines  # the start plan
        assert all(ln.startswith(("start: ", "waiting ", "step ", "checkpoint: ", "done: ")) for ln in lines), lines
        assert stderr.strip() == "", stderr[-2000:]
        assert (tmp_path / name / "driver.log").is_file()
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["final_loss"] == runs[name][-1]["loss"]
        # Where the start went: the wall clock per phase, and rank 0's worker CPU beside it (Ray's
        # own part before the train function, then ours: imports with transformers', and so on).
        phases = ["worker_imports", "process_group", "mesh", "model_build", "first_batch", "first_step"]
        assert list(summary["startup_s"]) == ["plan", "ray_init", "input_check", "worker_start", *phases,
                                              "total_to_first_step"], summary["startup_s"]  # fmt: skip
        cpu = summary["startup_cpu_s"]
        assert list(cpu) == ["ray_worker", *phases, "total_to_first_step"], cpu
        assert cpu["ray_worker"] > 0.5 and cpu["worker_imports"] > 0.5, cpu  # torch, Ray; transformers, DTensor
        assert min(cpu.values()) >= 0 and cpu["total_to_first_step"] == pytest.approx(
            sum(v for k, v in cpu.items() if k != "total_to_first_step"), abs=0.01), cpu  # fmt: skip
    for got, want in zip(runs["2x1x1"], reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert runs["2x1x1"][0]["loss"] > 7.0  # learning from scratch on the shipped 4096-token BPE


def test_mlflow_tracks_the_cli_run_from_rank_0(raw_text_runs, monkeypatch):
    """What `--set run.tracking=mlflow` with MLFLOW_TRACKING_URI gives, read with MLflow's own
    client: one run, the config as params, rank 0's loss once per step as metrics.jsonl has it,
    the checkpoint and the summary, ended FINISHED; the credential nowhere in what is kept."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tmp_path, _, done = raw_text_runs
    proc, stdout, stderr = done["2x1x1"]
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert [params[f"parallelism.{k}"] for k in ("dp", "tp", "pp", "microbatches")] == ["2", "1", "1", "2"]
    assert params["model.num_layers"] == "2" and params["run.tracking"] == "mlflow"
    steps = [json.loads(x) for x in (tmp_path / "2x1x1" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "grad_norm", "tokens_per_s"):
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(s["step"], s[key]) for s in steps], key
    summary = json.loads((tmp_path / "2x1x1" / "summary.json").read_text())
    assert run.data.metrics["summary.final_loss"] == summary["final_loss"]
    assert run.data.metrics["checkpoint.steps_done"] == 3
    assert run.data.tags["checkpoint.latest"] == summary["checkpoints"][-1]["path"]
    for path in [*(tmp_path / "2x1x1").rglob("*"), *(tmp_path / "mlruns").rglob("*")]:
        assert not path.is_file() or FAKE_TOKEN.encode() not in path.read_bytes(), path


@pytest.fixture(scope="module")
def labelled_rows(tmp_path_factory) -> tuple[Path, Path]:
    """A user's labelled table, written with plain pyarrow from the standard library: per
    function or class, its docstring's first paragraph and its signature (two texts), three
    raw numbers (unscaled) and a label (does the docstring mention what it returns)."""
    rows = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(a for a in dir(mod) if not a.startswith("_")):
            obj = getattr(mod, attr)
            doc = inspect.getdoc(obj) if inspect.isfunction(obj) or inspect.isclass(obj) else None
            if not doc:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            params = sig.count(",") + (sig not in ("()", "(...)"))
            rows.append(
                (
                    doc.split("\n\n")[0],
                    f"{name}.{attr}{sig}",
                    len(doc),
                    params,
                    float(inspect.isclass(obj)),
                    int("return" in doc.lower()),
                )
            )
    out = tmp_path_factory.mktemp("labelled")
    names = ["summary", "signature", "doc_chars", "n_params", "is_class", "mentions_return"]
    # Training rows for three global batches of 8 and 5 rows over: one pass (data.epochs=1) is 3 steps.
    for file, part in (("train.parquet", rows[:29]), ("val.parquet", rows[len(rows) * 4 // 5 :])):
        pq.write_table(pa.table(dict(zip(names, map(list, zip(*part, strict=True)), strict=True))), out / file)
    return out / "train.parquet", out / "val.parquet"


MULTIMODAL = (
    "model.arch=multimodal-bert",
    "model.pretrained=none",  # the shape of MiniLM at a tiny width: the suite's time budget
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.vocab_size=30522",
    "model.seq_len=24",
    "model.class_weights=[1, 3]",
    "train.steps=10",  # the LR schedule's; the data's one pass ends the run after step 3
    "data.epochs=1",
    "train.global_batch_size=8",
    "train.lr=1e-3",
    "train.eval_interval=2",
    "data.text_columns=summary,signature",
    "data.tabular_columns=doc_chars,n_params,is_class",
    "data.label_column=mentions_return",
)


@pytest.fixture(scope="module")
def multimodal_run(ray_local, labelled_rows, tmp_path_factory):
    """The classifier's CLI run, started at once: it runs beside the raw-text runs."""
    train, val = labelled_rows
    out = tmp_path_factory.mktemp("multimodal") / "run"
    sets = [*MULTIMODAL, f"data.path={train}", f"data.val_path={val}", f"run.output_dir={out}"]
    # Two replicas of one worker each: Ray Data's rows split over dp, each replica's validation rows
    # too (a Ray Train worker's start is ~10 s of the suite's CPU; the classifier's pipeline splits,
    # with validation, are tests/test_multimodal.py's).
    sets += ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=2"]
    sets.append(f"cluster.address={ray_local.get_runtime_context().gcs_address}")
    exe = Path(sys.executable).parent / "raytrain-hybrid"
    argv = [str(exe), "train", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc, out
    finally:
        proc.kill()


def test_multimodal_classifier_from_the_cli_matches_single_process_and_evaluates(labelled_rows, multimodal_run):
    from reference import classifier_reference_run, ray_data_rows

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.data.rows import read_parquet_rows

    train, val = labelled_rows
    proc, out = multimodal_run
    cfg = load_config(None, [*MULTIMODAL, f"data.path={train}", f"data.val_path={val}"])
    reference = classifier_reference_run(cfg, ray_data_rows(cfg, 3), val_rows=read_parquet_rows(val, cfg))
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "data.epochs=1: the rows hold 3 global batches of 8; the run ends after step 3 " in stdout, stdout
    steps = [ln for ln in stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/3", "2/3", "3/3"], steps
    assert ["val acc" in ln for ln in steps] == [False, True, True], steps  # every 2 steps and after the last
    history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [1, 2]
    assert summary["final_eval"] == {k: v for k, v in history[-1].items() if k == "step" or k.startswith("val_")}
    for got, want in zip(history, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    logits, labels = reference[-1]["val_logits"], reference[-1]["val_labels"]
    assert history[-1]["val_rows"] == len(labels)
    assert history[-1]["val_accuracy"] == pytest.approx((logits.argmax(1) == labels).sum().item() / len(labels))
    weights = torch.tensor([1.0, 3.0])[labels]
    val_loss = (weights * torch.nn.functional.cross_entropy(logits, labels, reduction="none")).mean().item()
    assert history[-1]["val_loss"] == pytest.approx(val_loss, rel=1e-4)
