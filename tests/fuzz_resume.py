"""Fuzzing target: a run directory resumed in place (``check --resume RUN``, the driver's checks a
``train --resume`` runs before Ray starts), with its metrics.jsonl and its checkpoint's files damaged:
lines cut off, replaced or filled with bytes; a shard emptied, cut short, flipped or grown; the DCP
metadata given an absurd shape; with the manifest's sizes and digests rewritten to match or not (as
someone who can write the bucket can). Every case must end accepted, or refused naming the run
directory or the checkpoint (exit 2), the files unchanged."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

from fuzz_targets import Crash, _cli, _digest, _named
from hypothesis import strategies as st

METRICS = st.tuples(
    st.sampled_from(["keep", "cut", "insert", "replace", "truncate", "empty"]),
    st.integers(0, 400),
    st.binary(max_size=48),
)
SHARDS = st.tuples(
    st.sampled_from(["keep", "empty", "truncate", "flip", "grow", "absurd_shape", "drop_entry"]),
    st.integers(0, 1 << 20),
    st.binary(min_size=1, max_size=32),
    st.booleans(),  # the manifest's sizes and digests rewritten to match the damaged files
)
RESUME_FILES = st.tuples(METRICS, SHARDS)


def _metrics(path: Path, case) -> None:
    kind, at, junk = case
    lines = [json.dumps({"step": s, "loss": 7.0 - s, "grad_norm": 1.0, "lr": 1e-3}) for s in range(2)]
    data = ("\n".join(lines) + "\n").encode()
    at %= len(data) + 1
    if kind == "cut":
        data = data[: len(data) - 1 - at % 20]
    elif kind == "insert":
        data = data[:at] + junk + data[at:]
    elif kind == "replace":
        data = data[:at] + junk + data[at + len(junk) :]
    elif kind == "truncate":
        data = data[:at]
    elif kind == "empty":
        data = b""
    path.write_bytes(data)


def _shards(step: Path, case) -> None:
    import torch

    from raytrain_hybrid.checkpoint.manifest import MANIFEST, file_digest
    from raytrain_hybrid.checkpoint.reader import parse_metadata

    kind, at, junk, rewrite = case
    shards = sorted(step.glob("*.distcp"))
    shard = shards[at % len(shards)]
    data = shard.read_bytes()
    at %= len(data) + 1
    if kind == "empty":
        shard.write_bytes(b"")
    elif kind == "truncate":
        shard.write_bytes(data[:at])
    elif kind == "flip":
        shard.write_bytes(data[:at] + bytes(b ^ 0xFF for b in junk) + data[at + len(junk) :])
    elif kind == "grow":
        shard.write_bytes(data + junk)
    elif kind in ("absurd_shape", "drop_entry"):
        md = parse_metadata((step / ".metadata").read_bytes())
        names = sorted(md.state_dict_metadata)
        name = names[at % len(names)]
        if kind == "absurd_shape":
            md.state_dict_metadata[name].size = torch.Size([1 << (10 + at % 40), 1 + at % 7])
        else:
            del md.state_dict_metadata[name]
        (step / ".metadata").write_bytes(pickle.dumps(md))
    if rewrite:
        manifest = json.loads((step / MANIFEST).read_text())
        manifest["files"] = {p.name: file_digest(p) for p in sorted(step.iterdir()) if p.name != MANIFEST}
        (step / MANIFEST).write_text(json.dumps(manifest))


def run_resume_files(case, workdir: Path) -> str:
    from fuzz_files import TINY, _checkpoint

    source, _ = _checkpoint()
    run = workdir / "run"
    step = run / "checkpoints" / "step_2"
    shutil.copytree(source, step)
    metrics_case, shard_case = case
    _metrics(run / "metrics.jsonl", metrics_case)
    _shards(step, shard_case)
    before = _digest(run)
    sets = [a for kv in [*TINY, f"run.output_dir={run}"] for a in ("--set", kv)]
    code, err = _cli(["check", "--resume", str(run), *sets])
    if _digest(run) != before:
        raise Crash("the run directory changed")
    if code == 0:
        return "accepted"
    if code != 2:
        raise Crash(f"exit {code}: {err[-300:]!r}")
    _named(err, {"--resume", "run.output_dir", "train.steps"})
    if str(run) not in err:
        raise Crash(f"refusal does not name the run or its checkpoint: {err[:300]!r}")
    return "refused"
