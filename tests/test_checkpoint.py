"""Checkpoints: resume under other layouts, export to Hugging Face, refuse damaged checkpoints.

The oracle holds across a checkpoint: a run saved at (2,2,2) after every step (in the
background, each save overlapping the next step) and resumed from its step 2 at (4,1,2),
(1,2,4), (1,1,1) or (1,1,2) under DualPipeV gives the uninterrupted single-process run's steps 3 and 4 (losses, every
parameter's gradient norm) and its final parameters. A save that fails half-way fails the run
and leaves the checkpoint before it the newest complete one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import reference_history
from gloo_harness import run_gloo
from test_oracle import assert_oracle

from raytrain_hybrid.checkpoint import manifest as checkpoint
from raytrain_hybrid.cli import main as cli
from raytrain_hybrid.errors import ConfigError

STEPS = 4
COMMON = (f"train.steps={STEPS}", "model.num_layers=4", "train.global_batch_size=16", "model.seq_len=32")
# Saved under ZeRO-1 (AdamW state in flat slices per DP rank, written per parameter) and
# resumed under ZeRO-1 with other slices, and under plain AdamW.
SAVED_AT = (
    "parallelism.dp=2",
    "parallelism.tp=2",
    "parallelism.pp=2",
    "parallelism.microbatches=2",
    "parallelism.zero=1",
)
RESUME_AT = {
    "4x1x2-zero1": (
        "parallelism.dp=4",
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.microbatches=2",
        "parallelism.zero=1",
    ),
    "1x2x4": ("parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=4", "parallelism.microbatches=4"),
    "1x1x1": ("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"),
    # Into a V layout: each rank's first and last stage gathered from the looped stages saved.
    "1x1x2-dualpipev": ("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2", "parallelism.schedule=DualPipeV"),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A (2,2,2) run of 4 steps with a checkpoint after each, written in the background
    (checkpoint.async_save's default; gloo processes, no Ray)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    result = run_gloo([*COMMON, *SAVED_AT, "checkpoint.interval=1", f"run.output_dir={out}"])
    return out, result


def test_saved_run_matches_and_each_rank_writes_its_share(saved_run):
    out, result = saved_run
    assert_oracle(result, reference_history(COMMON))
    step2 = out / "checkpoints" / "step_2"
    manifest = checkpoint.verify(step2)
    assert manifest["step"] == 2 and manifest["world_size"] == 8
    assert manifest["layout"]["tp"] == 2 and manifest["config"]["model"]["hidden_size"] == 128
    shards = [step2 / f"__{r}_0.distcp" for r in range(8)]
    sizes = [s.stat().st_size for s in shards]
    # model + AdamW moments, fp32: 12 bytes a parameter in all; each rank writes about 1/8
    # (replicas split the replicated shards between them rather than all writing them).
    total = sum(sizes)
    assert max(sizes) < 1.25 * total / 8, sizes
    assert not list((out / "checkpoints").glob("*.partial"))
    # Every save completed (a save waits for the one before it; the run for the last), and the
    # step loop waited only for part of each.
    assert [p.name for p in checkpoint.step_dirs(out / "checkpoints")] == [f"step_{n}" for n in range(1, 5)]
    for n in range(1, 4):
        assert checkpoint.verify(out / "checkpoints" / f"step_{n}")["step"] == n
    for m in result["history"]:
        assert 0 < m["blocked_s"] and 0 < m["write_s"] <= m["save_s"], m


@pytest.mark.parametrize("name", list(RESUME_AT))
def test_resume_under_another_layout_matches_the_uninterrupted_run(saved_run, tmp_path, name):
    out, _ = saved_run
    result = run_gloo(
        [*COMMON, *RESUME_AT[name], f"run.output_dir={tmp_path / 'run'}"], resume=str(out / "checkpoints" / "step_2")
    )
    assert_oracle(result, reference_history(COMMON), first=2)


def test_a_resume_that_raises_train_steps_stretches_the_schedule_as_documented(saved_run, tmp_path):
    """--allow-change train.steps (docs/checkpoints.md): the 4-step run resumed from step 2 with
    train.steps=5 goes on with the cosine decay stretched to 5 steps from step 3 on; its steps
    (learning rate, loss, every gradient norm) and final weights are a one-process run's whose
    first two steps followed the 4-step schedule and the rest the 5-step one. (With 6 steps the
    larger learning rates move the gradient norms past the oracle's 1e-4 at the fifth step, as
    longer runs do at any layout.)"""
    from reference import reference_run

    from raytrain_hybrid.config import load_config

    out, _ = saved_run
    longer = [*COMMON[1:], "train.steps=5"]
    result = run_gloo(
        [*longer, *RESUME_AT["1x1x1"], f"run.output_dir={tmp_path / 'run'}"], resume=str(out / "checkpoints" / "step_2")
    )
    torch.manual_seed(0)
    want = reference_run(load_config(None, longer), stretched=(2, STEPS))
    assert_oracle(result, want, first=2)
    assert want[3]["lr"] > reference_history(COMMON)[3]["lr"]  # the stretch the docs describe: a higher lr


def test_export_round_trip_logits(saved_run, tmp_path):
    """The exported directory loads offline with AutoModelForCausalLM; its logits equal both the
    checkpoint's own model and the reference loop's model after the same 4 steps."""
    from reference import reference_run
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.checkpoint.export import load_full_state_dict
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.data.corpus import TokenWindows, tokenize_corpus
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    out, _ = saved_run
    exported = tmp_path / "hf"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "raytrain-hybrid"), "export", str(out), str(exported)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()

    cfg = load_config(None, list(COMMON))
    batch = TokenWindows(tokenize_corpus(), cfg.model.seq_len, 0).rows_to_batch(torch.arange(4).numpy()).input_ids
    spec = get_arch("llama")
    stage = build_stage(spec, spec.hf_config(cfg), list(range(4)), first=True, last=True)
    stage.to_empty(device="cpu")
    spec.init_buffers(stage, spec.hf_config(cfg), torch.device("cpu"))
    stage.load_state_dict(load_full_state_dict(out / "checkpoints" / "step_4", cfg))
    trained: list = []
    reference_run(cfg, keep_model=trained)
    with torch.no_grad():
        got = hf(input_ids=batch).logits
        torch.testing.assert_close(got, stage(batch), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, trained[0](input_ids=batch).logits, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------ damaged checkpoints


def _damaged(saved_run, tmp_path, damage) -> Path:
    out, _ = saved_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    damage(copy / "checkpoints" / "step_4")
    return copy


def _truncate(d: Path):
    f = d / "__3_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])


def _flip(d: Path):
    f = d / "__5_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (_truncate, "has a truncated __3_0.distcp"),
    "corrupted": (_flip, "has a corrupted __5_0.distcp"),
    "missing shard": (lambda d: (d / "__6_0.distcp").unlink(), "is missing the shard __6_0.distcp"),
    "interrupted save": (
        lambda d: (d / "manifest.json").unlink(),
        "is not a complete checkpoint: manifest.json is missing",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_refused_and_nothing_is_written(saved_run, tmp_path, case, capsys):
    damage, message = DAMAGE[case]
    run_dir = _damaged(saved_run, tmp_path, damage)
    step4 = run_dir / "checkpoints" / "step_4"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    target = tmp_path / "resumed"
    code = cli(["train", "--resume", str(step4), "--set", f"run.output_dir={target}", "--set", "train.steps=6"])
    err = capsys.readouterr().err
    assert code == 2 and f"--resume='{step4}': {message}" in err, err
    assert not target.exists()  # refused before anything was created
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # The run directory still resumes: its newest intact checkpoint is step_3.
    path, manifest = checkpoint.resolve(run_dir)
    assert path.name == "step_3" and manifest["step"] == 3


def test_a_checkpoint_over_the_digest_limit_is_checked_by_sizes_and_metadata(saved_run, tmp_path, monkeypatch):
    """A 70B run's checkpoint is not streamed through the driver for its SHA-256 at every resume:
    over the limit, sizes and the metadata are checked (a truncated shard is still refused)."""
    run_dir = _damaged(saved_run, tmp_path, _flip)
    monkeypatch.setattr(checkpoint, "DIGEST_LIMIT_BYTES", 0)
    assert checkpoint.verify(run_dir / "checkpoints" / "step_4")["verified"] == "sizes"
    assert checkpoint.verify(run_dir / "checkpoints" / "step_3", digests=True)["verified"] == "sha256"
    _truncate(run_dir / "checkpoints" / "step_3")
    with pytest.raises(ConfigError, match="has a truncated __3_0.distcp"):
        checkpoint.verify(run_dir / "checkpoints" / "step_3")


def test_checkpoint_of_another_model_is_refused_by_the_cli(saved_run, tmp_path):
    out, _ = saved_run
    done = subprocess.run(
        [str(Path(sys.executable).parent / "raytrain-hybrid"), "train", "--resume", str(out),
         "--set", "model.hidden_size=256", "--set", "train.steps=6", "--set", f"run.output_dir={tmp_path / 'r'}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert "model.hidden_size=256: the checkpoint" in done.stderr and "model.hidden_size=128" in done.stderr


def test_an_earlier_runs_directory_is_not_overwritten(saved_run, capsys):
    out, _ = saved_run
    assert cli(["train", "--set", f"run.output_dir={out}"]) == 2  # a fresh run into a dir with checkpoints
    assert "holds checkpoints of an earlier run (step_4); continue it with --resume" in capsys.readouterr().err


def test_a_finished_runs_resume_completes_its_records_or_is_refused(saved_run, tmp_path, capsys, monkeypatch):
    """A driver killed as its workers completed the last step and its checkpoint: metrics.jsonl
    lacks that step and summary.json is not written. A resume has nothing left to train: it
    writes both from the checkpoints' records, says so in one line and exits 0, without Ray
    (and leaves the killed driver's log as it was). `check --resume` says the same and writes
    nothing. Once the records are whole, a resume is refused as a finished run's."""
    from raytrain_hybrid.launch.runtime import driver

    out, result = saved_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in result["history"][:3]))
    (run / "driver.log").write_text("the killed driver's log\n")
    sets = [a for s in [*COMMON, f"run.output_dir={run}"] for a in ("--set", s)]
    said = (
        f"the checkpoint {run}/checkpoints/step_4 has done all 4 steps; "
        "metrics.jsonl lacked step 4 and summary.json its end: "
    )
    assert cli(["check", "--resume", str(run), *sets]) == 0
    assert "resume: nothing left to train: " + said + "train --resume writes" in capsys.readouterr().out
    assert not (run / "summary.json").exists() and len((run / "metrics.jsonl").read_text().splitlines()) == 3

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a run with nothing left to train")

    monkeypatch.setattr(driver, "start_run", no_ray)
    assert cli(["train", "--resume", str(run), *sets]) == 0
    told = capsys.readouterr()
    assert told.out.splitlines() == [f"resume: nothing left to train: {said}written from the checkpoints' records"], (
        told
    )
    assert not told.err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["loss"] for r in records] == [h["loss"] for h in result["history"]]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ended"] == "completed" and summary["steps"] == 4 and "steps_unrecorded" not in summary
    assert summary["final_loss"] == result["history"][-1]["loss"]
    assert (run / "driver.log").read_text() == "the killed driver's log\n"
    code = cli(["train", "--resume", str(run), *sets])
    assert code == 2 and "has done 4 steps already; raise train.steps" in capsys.readouterr().err


# ------------------------------------------------------------------ planted checkpoints
# Anyone who can write the bucket can rewrite a checkpoint and its manifest to match. Two plants
# that ran a command before the reader was hardened: a .metadata whose pickle names
# os.system through a DCP module (protocol 4 follows dotted names), and a tensor re-marked as a
# "bytes" entry, which DCP's default planner hands to torch.load(weights_only=False).


def _global_pickle(module: str, name: str, arg: str | None = None) -> bytes:
    """Protocol 4 by hand: STACK_GLOBAL(module, name), called with ``arg`` if one is given."""
    import struct

    def s(text: str) -> bytes:
        raw = text.encode()
        return b"\x8c" + struct.pack("<B", len(raw)) + raw  # SHORT_BINUNICODE

    call = b"" if arg is None else s(arg) + b"\x85R"  # TUPLE1, REDUCE
    return b"\x80\x04" + s(module) + s(name) + b"\x93" + call + b"."


def _plant_gadget(step: Path, marker: Path) -> None:
    gadget = _global_pickle("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}")
    (step / ".metadata").write_bytes(gadget)


def _plant_bytes_entry(step: Path, marker: Path) -> None:
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    md = pickle.loads((step / ".metadata").read_bytes())  # the test trusts its own fixture
    key = "model.model.norm.weight"
    buf = io.BytesIO()
    torch.save(Payload(), buf)
    (step / "__9_0.distcp").write_bytes(buf.getvalue())
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn != key}
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
    (step / ".metadata").write_bytes(pickle.dumps(md))


def _rewrite_manifest(step: Path) -> None:
    """As an attacker would: every file's size and digest made to match."""
    manifest = json.loads((step / "manifest.json").read_text())
    names = [p.name for p in step.iterdir() if p.name != "manifest.json"]
    manifest["files"] = {n: checkpoint.file_digest(step / n) for n in names}
    (step / "manifest.json").write_text(json.dumps(manifest))


PLANTS = {"gadget metadata": _plant_gadget, "bytes entry": _plant_bytes_entry}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_checkpoint_runs_no_code_on_resume_export_or_restart(saved_run, tmp_path, plant, capsys):
    out, _ = saved_run
    run_dir, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(out, run_dir)
    step = run_dir / "checkpoints" / "step_4"
    PLANTS[plant](step, marker)
    _rewrite_manifest(step)

    # train --resume: refused on the driver before anything starts.
    target = tmp_path / "resumed"
    code = cli(["train", "--resume", str(step), "--set", f"run.output_dir={target}", "--set", "train.steps=6"])
    err = capsys.readouterr().err
    assert code == 2 and f"--resume='{step}': is refused: its .metadata" in err, err
    assert not target.exists()
    # export: refused the same way, nothing written.
    assert cli(["export", str(step), str(tmp_path / "hf")]) == 2
    assert "is refused: its .metadata" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    # A worker group's start (a restart, an elastic resize) loads without the driver's check:
    # the workers' own check refuses it, and the reader's planner would refuse a bytes entry anyway.
    with pytest.raises(AssertionError, match=r"is refused: its \.metadata"):
        run_gloo([*COMMON, *RESUME_AT["1x1x1"], "train.steps=6", f"run.output_dir={target}"], resume=str(step))
    if plant == "bytes entry":
        from types import SimpleNamespace

        from raytrain_hybrid.checkpoint.reader import SafeLoadPlanner, UnsafeCheckpoint, safe_load

        with pytest.raises(UnsafeCheckpoint, match="BytesStorageMetadata, which a checkpoint never holds"):
            safe_load({"model": {"model.model.norm.weight": torch.zeros(128)}}, step, no_dist=True)
        # Were a bytes entry to get past the metadata check, the planner would not unpickle it.
        item = SimpleNamespace(dest_index=SimpleNamespace(fqn="model.model.norm.weight"))
        with pytest.raises(UnsafeCheckpoint, match="never unpickles"):
            SafeLoadPlanner().load_bytes(item, (step / "__9_0.distcp").open("rb"))
    assert not marker.exists()
    # A run directory whose newest checkpoint is planted resumes from the one before it.
    path, manifest = checkpoint.resolve(run_dir)
    assert path.name == "step_3" and manifest["step"] == 3


def test_metadata_reader_admits_exact_pairs_only(saved_run):
    """The unpickler's list is (module, name) pairs: no prefix of a module, no dotted name."""
    from raytrain_hybrid.checkpoint.reader import ALLOWED, UnsafeCheckpoint, parse_metadata

    out, _ = saved_run
    md = parse_metadata((out / "checkpoints" / "step_4" / ".metadata").read_bytes())
    assert "model.model.embed_tokens.weight" in md.state_dict_metadata
    assert all("." not in name for _, name in ALLOWED)
    refused = [
        ("torch.distributed.checkpoint.filesystem", "os.system"),
        ("posix", "system"),
        ("torch.distributed.checkpoint.metadata", "Metadata.__class__"),
        ("builtins", "eval"),
    ]
    for module, name in refused:
        with pytest.raises(UnsafeCheckpoint, match="which a checkpoint never holds"):
            parse_metadata(_global_pickle(module, name))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_save_that_fails_half_way_fails_the_run_and_keeps_the_previous_checkpoint(tmp_path, mode):
    """Rank 1's save of step_2 fails after DCP's write (in the background, or in the step with
    checkpoint.async_save=false): every rank raises, nothing of step_2 counts as complete, and
    the run fails rather than going on to save step 3. Two ranks (dp=2): the ranks agree on a
    save's outcome in one collective over the world, whatever the layout (the default 2x2x2
    took 8 processes, ~17 s of CPU a case, for the same check)."""
    out = tmp_path / "run"
    overrides = [*COMMON, "train.steps=3", "parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1",
                 "parallelism.microbatches=1", "checkpoint.interval=1", f"run.output_dir={out}",
                 f"checkpoint.async_save={str(mode == 'async').lower()}"]  # fmt: skip
    with pytest.raises(AssertionError, match=r"saving checkpoint \S*step_2 failed: rank 1: OSError\('injected"):
        run_gloo(overrides, fail_save=(2, 1))
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2.partial"]
    assert not (ckpts / "step_2.partial" / "manifest.json").exists()
    path, manifest = checkpoint.resolve(out)
    assert path.name == "step_1" and manifest["step"] == 1


# ------------------------------------------------------------------ a resume continues its run

CHANGES = {
    "train.global_batch_size=32": ("train.global_batch_size", "train.global_batch_size=16"),
    "train.lr=0.01": ("train.lr", "train.lr=0.003"),  # (0 in the config: picked for the model)
    "train.warmup_steps=5": ("train.warmup_steps", "train.warmup_steps=2"),
    "train.seed=7": ("train.seed", "train.seed=0"),
    "data.shuffle_seed=3": ("data.shuffle_seed", "data.shuffle_seed=0"),
    "train.weight_decay=0.01": ("train.weight_decay", "train.weight_decay=0.1"),
    "train.grad_clip=0.5": ("train.grad_clip", "train.grad_clip=1.0"),
    "train.dtype=bfloat16": ("train.dtype", "train.dtype='float32'"),
    "train.fp8=rowwise": ("train.fp8", "train.fp8='off'"),  # (emulated on a CPU: the casts' rounding)
    "data.text_column=body": ("data.text_column", "data.text_column=''"),  # another column: other data
    # the learning-rate schedule's horizon: the cosine decay would be stretched (given last: wins)
    "train.steps=6": ("train.steps", "train.steps=4"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_resume_that_changes_the_trajectory_is_refused_naming_the_key(saved_run, tmp_path, change, capsys):
    out, _ = saved_run
    key, was = CHANGES[change]
    target = tmp_path / "r"
    sets = [*COMMON[1:], change, "train.steps=6", f"run.output_dir={target}"]
    sets += ["train.fp8_emulate=true"] if key == "train.fp8" else []
    code = cli(["train", "--resume", str(out), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2, err
    # The value whole (the refusal goes on after ";"): "train.lr=0.0" must not pass for 0.0003.
    shown = {"train.dtype=bfloat16": "train.dtype='bfloat16'", "train.fp8=rowwise": "train.fp8='rowwise'",
             "data.text_column=body": "data.text_column='body'"}.get(change, change)  # fmt: skip
    assert f"{shown}: " in err and f"was trained with {was}; " in err, err
    assert f"--allow-change {key}" in err and not target.exists()


def test_allowed_changes_and_new_data_are_said_and_checked(saved_run, tmp_path):
    """--allow-change lets a key differ (a data change starts the data over); a changed
    tokenizer or data set is refused by content, whatever its path."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.data.tokenizer import DEFAULT_TOKENIZER
    from raytrain_hybrid.launch.runtime.start import check_resume

    out, _ = saved_run
    said: list[str] = []
    cfg = load_config(None, [*COMMON, "train.steps=6", "train.lr=0.01", f"run.output_dir={tmp_path / 'a'}"])
    point = check_resume(cfg, str(out), ["train.lr,train.steps"], said.append)
    assert point.data_origin == 0 and said == [
        "resume: train.lr differs from the checkpoint's (allowed by --allow-change)",
        "resume: train.steps differs from the checkpoint's (allowed by --allow-change)",
    ]
    cfg = load_config(None, [*COMMON, "train.steps=6", "train.global_batch_size=8", f"run.output_dir={tmp_path / 'b'}"])
    point = check_resume(cfg, str(out), ["train.global_batch_size", "train.steps"], said.append)
    assert point.data_origin == 4 and said[-1] == "resume: the data starts from its beginning at step 5"
    tok = tmp_path / "tokenizer.json"
    tok.write_text(DEFAULT_TOKENIZER.read_text().replace('"unk_token":null', '"unk_token": null'))
    tok.write_bytes(tok.read_bytes() + b"\n")  # another file, however small the difference
    cfg = load_config(None, [*COMMON, "train.steps=6", f"data.tokenizer={tok}", f"run.output_dir={tmp_path / 'c'}"])
    with pytest.raises(ConfigError, match="data.tokenizer=.*its tokenizer.json differ.*--allow-change data.tokenizer"):
        check_resume(cfg, str(out))
    with pytest.raises(ConfigError, match="--allow-change='checkpoint.interval': is not a key a resume compares"):
        check_resume(cfg, str(out), ["checkpoint.interval"])


def test_data_replaced_by_files_of_the_same_size_is_refused_and_unreadable_data_is_said(tmp_path):
    """The data check looks at the files' content (sampled: their heads and Parquet footers), not
    only their names and sizes; data it cannot read now, or that the checkpoint's run could not
    read, is said as not verified."""
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_hybrid.checkpoint.trajectory import check_trajectory, describe
    from raytrain_hybrid.config import load_config

    data = tmp_path / "data"
    data.mkdir()
    for n in range(2):
        pq.write_table(pa.table({"input_ids": [[n, 1, 2, 3]] * 8}), data / f"part-{n}.parquet")
    cfg = load_config(None, ["data.path=memory"])
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data)))
    manifest = {"trajectory": describe(cfg)}
    assert check_trajectory(cfg, manifest, "ckpt", []) == []
    replaced = bytearray((data / "part-1.parquet").read_bytes())
    replaced[len(replaced) // 3] ^= 0xFF  # other bytes, the same name and size
    (data / "part-1.parquet").write_bytes(bytes(replaced))
    with pytest.raises(ConfigError, match="data.path=.*the files under it differ.*--allow-change data.path"):
        check_trajectory(cfg, manifest, "ckpt", [])
    assert check_trajectory(cfg, manifest, "ckpt", ["data.path"]) == ["data.path"]
    gone = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(tmp_path / "moved")))
    unverified: list[str] = []
    assert check_trajectory(gone, manifest, "ckpt", [], unverified) == [] and unverified == ["data.path"]
    # Data the saving run could not read (recorded as None): nothing to compare, said as such.
    unread = {"trajectory": {**manifest["trajectory"], "data.path": None, "data.content": None}}
    unrecorded: list[str] = []
    assert check_trajectory(cfg, unread, "ckpt", [], [], unrecorded) == [] and unrecorded == ["data.path"]


def test_the_skipped_stream_stands_where_the_checkpoint_recorded(tmp_path):
    """After skipping a resumed run's steps, the stream's position is the one the run recorded at
    that step (what ReplicaFeed compares with the manifest); other data gives another one."""
    import numpy as np
    import pyarrow as pa

    from raytrain_hybrid.data.sources import TokenDocuments
    from raytrain_hybrid.data.stream import ReplicaStream

    class Rows:
        def __init__(self, docs):
            self.docs = docs

        def iter_batches(self, batch_size, batch_format):
            for i in range(0, len(self.docs), batch_size):
                yield pa.table({"input_ids": self.docs[i : i + batch_size]})

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, rng.integers(5, 40)).tolist() for _ in range(200)]

    def stream(d, skip):
        source = TokenDocuments(Rows(d), "input_ids", seq_len=16, vocab_size=100)
        return ReplicaStream(source, global_batch=4, dp=1, dp_rank=0, seed=0, skip_steps=skip)

    full = stream(docs, 0)
    recorded = [full.position.manifest_entry() for _ in zip(range(3), full, strict=False)][-1]  # after step 3
    resumed = stream(docs, 3)
    first = next(iter(resumed))
    assert resumed.position.skipped_to == recorded and resumed.position.steps == 4
    assert np.array_equal(first, next(iter(stream(docs, 3))))
    other = stream(docs[1:], 3)
    next(iter(other))
    assert other.position.skipped_to != recorded


def test_a_checkpoint_from_before_a_new_model_key_still_resumes(saved_run, tmp_path):
    """A model key added after a checkpoint was written (its manifest lacks it) compares as the
    key's default, not as a different model."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.runtime.start import check_resume

    out, _ = saved_run
    old = tmp_path / "old"
    shutil.copytree(out / "checkpoints" / "step_4", old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["config"]["model"]["pretrained_revision"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_config(None, [*COMMON, "train.steps=6", f"run.output_dir={tmp_path / 'r'}"])
    assert check_resume(cfg, str(old), ["train.steps"]).step == 4


def test_rh_train_allow_change_is_the_clis(saved_run, tmp_path, capsys):
    """rh.train(..., allow_change=) is `train --allow-change`: without it the change is refused
    naming the key; with it the resume is accepted and said, and the run goes on to its input
    check (here a data set that does not exist: refused before Ray starts)."""
    import raytrain_hybrid as rh

    out, _ = saved_run
    missing = tmp_path / "nope.parquet"
    cfg = rh.load_config(
        None, [*COMMON, "train.steps=6", "train.lr=0.01", f"data.path={missing}", f"run.output_dir={tmp_path / 'r'}"]
    )
    with pytest.raises(ConfigError, match="--allow-change train.lr"):
        rh.train(cfg, resume=str(out), allow_change=["train.steps", "data.path"])
    with pytest.raises(ConfigError, match="data.path=.*does not exist"):
        rh.train(cfg, resume=str(out), allow_change=["train.lr", "train.steps", "data.path"])
    said = capsys.readouterr().out
    assert "resume: train.lr differs from the checkpoint's (allowed by --allow-change)" in said, said


def test_steps_a_killed_driver_never_heard_of_come_from_the_checkpoints(saved_run, tmp_path, capsys):
    """A driver killed while its workers go on: they train and save steps it never hears of, so
    its metrics.jsonl stops short of the checkpoint a resume picks (here it heard of step 1 of
    4). The resume takes those steps' metrics from the checkpoints' records (each keeps the steps
    since the save before it) and says so; where no checkpoint kept them (one pruned), it says
    which steps have no record, and summary.json lists them."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.records.summary import summarize
    from raytrain_hybrid.launch.runtime.start import check_resume

    out, result = saved_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "metrics.jsonl").write_text(json.dumps(result["history"][0]) + "\n")
    sets = [*COMMON[1:], "train.steps=6", f"run.output_dir={run}"]
    cfg = load_config(None, sets)
    said: list[str] = []
    point = check_resume(cfg, str(run), ["train.steps"], said.append)
    assert point.step == 4 and [h["step"] for h in point.history] == [0, 1, 2, 3]
    for got, want in zip(point.history, result["history"], strict=True):  # rank 0's metrics, as it sent them
        assert {k: got[k] for k in ("loss", "grad_norm", "lr")} == {k: want[k] for k in ("loss", "grad_norm", "lr")}
    taken = "resume: metrics.jsonl lacked steps 2-4 (trained after its driver stopped hearing, a driver killed?)"
    assert said[-1].startswith(taken)
    assert "steps_unrecorded" not in summarize(cfg, point.history, [])
    # `check --resume` says it as `train --resume` would (and writes nothing).
    assert (
        cli(["check", "--resume", str(run), "--allow-change", "train.steps", *[a for s in sets for a in ("--set", s)]])
        == 0
    )
    assert taken in capsys.readouterr().out
    shutil.rmtree(run / "checkpoints" / "step_3")  # its record of step 3 gone with it
    said.clear()
    point = check_resume(cfg, str(run), ["train.steps"], said.append)
    assert [h["step"] for h in point.history] == [0, 1, 3]
    assert said[-1] == "resume: no record of step 3 was kept (not in metrics.jsonl nor in a checkpoint here)"
    assert summarize(cfg, point.history, [])["steps_unrecorded"] == [2]
