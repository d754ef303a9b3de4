"""Fuzzing targets that read a file the trainer finds in a directory: a checkpoint's manifest.json
(read by ``export``) and a pretrained directory's config.json (read by ``check``); the table of
every target, the classes of crash already found outside the fuzzed code, and ``run_case``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import tempfile
from pathlib import Path

from fuzz_resume import RESUME_FILES, run_resume_files
from fuzz_shapes import DEEP_FILES, LONG_VALUES, run_deep_files, run_long_values
from fuzz_targets import (
    CHAT_ROWS,
    CONFIG_FILES,
    DATA_BASE,
    HERE,
    JSONL_ROWS,
    KEYS,
    LOCATION_KEYS,
    SECTIONS,
    SET_VALUES,
    Crash,
    _cli,
    _digest,
    _json_scalar,
    _named,
    _text,
    run_chat_rows,
    run_config_file,
    run_jsonl_rows,
    run_set_values,
)
from hypothesis import strategies as st

# --- a checkpoint's manifest.json (export and resume read it) ----------------------------------

_json = st.recursive(
    _json_scalar | st.floats(allow_nan=True, allow_infinity=True),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text(6), inner, max_size=3),
    max_leaves=8,
)
# A path into a JSON tree (keys or indexes, resolved against the tree as far as they go) and what
# happens there.
_edit = st.tuples(st.lists(st.one_of(st.integers(0, 8), _text(6)), max_size=4), st.sampled_from(["set", "del"]), _json)
JSON_EDITS = st.one_of(
    st.lists(_edit, min_size=1, max_size=3).map(lambda e: ("edits", e)),
    st.binary(max_size=80).map(lambda b: ("bytes", b)),
    _json.map(lambda j: ("whole", j)),
)


_small_int = st.one_of(st.integers(-2, 70000), st.sampled_from([2**31, 2**63 - 1, 10**30]))
# Edits where the readers look: the model's sizes in a manifest's config, a config.json's keys.
_MANIFEST_KEYS = [["config", s, k] for s in ("model", "parallelism", "train") for k in sorted(SECTIONS[s])]
_MANIFEST_KEYS += [["step"], ["format"], ["files"], ["config"], ["world_size"]]
MANIFEST_EDITS = st.one_of(
    JSON_EDITS,
    st.lists(
        st.tuples(st.sampled_from(_MANIFEST_KEYS), st.just("set"), st.one_of(_small_int, _json)), min_size=1, max_size=3
    ).map(lambda e: ("edits", e)),
)


def mutate(tree, edits):
    """``tree`` with each edit applied where its path leads (a real key or index at each level)."""
    tree = json.loads(json.dumps(tree))
    for path, op, value in edits:
        node, parent, last = tree, None, None
        for part in path:
            if isinstance(node, dict) and node and isinstance(part, int):
                key = sorted(node)[part % len(node)]
            elif isinstance(node, list) and node and isinstance(part, int):
                key = part % len(node)
            elif isinstance(node, dict) and isinstance(part, str):
                key = part  # a key of its own: added by a "set"
            else:
                break
            parent, last = node, key
            if key not in node if isinstance(node, dict) else False:
                break
            node = node[key]
        if parent is None:
            if op == "set":
                tree = copy.deepcopy(value)
        elif op == "del":
            if isinstance(parent, dict):
                parent.pop(last, None)
            else:
                del parent[last]
        else:
            parent[last] = copy.deepcopy(value)  # (the same value set twice would nest in itself)
    return tree


def _fuzzed_json(case, original: dict) -> bytes:
    kind, body = case
    if kind == "bytes":
        return body
    tree = mutate(original, body) if kind == "edits" else body
    return json.dumps(tree).encode()


TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.vocab_size=4096",
    "model.seq_len=16",
    *DATA_BASE[:5],
]


def training_state(cfg, optimizer: bool = True) -> dict:
    """What a checkpoint of ``cfg``'s model holds, as a run saves it (checkpoint.state): every
    parameter under its global name, random, and with ``optimizer`` its AdamW state."""
    import torch

    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(spec.num_blocks(cfg.model))), first=True, last=True)
    torch.manual_seed(0)
    state = {"model": {n: torch.randn(p.shape) * 0.02 for n, p in meta.named_parameters()}}
    if optimizer:  # (checkpoint.state.optimizer_state's names)
        state["optimizer"] = {
            f"{n}.{k}": torch.tensor(2.0) if k == "step" else torch.zeros(p.shape)
            for n, p in meta.named_parameters()
            for k in ("step", "exp_avg", "exp_avg_sq")
        }
    return state


def make_checkpoint(step: Path, optimizer: bool = True) -> dict:
    """A checkpoint as a run writes it (DCP shards of the model and, with ``optimizer``, its AdamW
    state; manifest.json listing their sizes and digests), written in this process; returns its
    manifest."""
    import torch.distributed.checkpoint as dcp

    from raytrain_hybrid.checkpoint.manifest import FORMAT, MANIFEST, file_digest
    from raytrain_hybrid.config import load_config

    cfg = load_config(None, TINY)
    with contextlib.redirect_stderr(io.StringIO()):
        dcp.save(training_state(cfg, optimizer), checkpoint_id=str(step), no_dist=True)
    files = {p.name: file_digest(p) for p in sorted(step.iterdir())}
    manifest = {"format": FORMAT, "step": 2, "world_size": 1, "config": cfg.to_dict(), "files": files}
    (step / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


_CHECKPOINT: tuple[Path, dict] | None = None


def _checkpoint() -> tuple[Path, dict]:
    global _CHECKPOINT
    if _CHECKPOINT is None:
        step = Path(tempfile.mkdtemp(prefix="fuzz-ckpt-")) / "run" / "checkpoints" / "step_2"
        step.mkdir(parents=True)
        _CHECKPOINT = step, make_checkpoint(step)
    return _CHECKPOINT


def run_manifest(case, workdir: Path) -> str:
    import shutil

    source, manifest = _checkpoint()
    step = workdir / "run" / "checkpoints" / "step_2"
    shutil.copytree(source, step)
    (step / "manifest.json").write_bytes(_fuzzed_json(case, manifest))
    before = _digest(workdir / "run")
    code, err = _cli(["export", str(workdir / "run"), str(workdir / "hf")])
    if _digest(workdir / "run") != before:
        raise Crash("the checkpoint changed")
    if code == 0:
        return "accepted"
    if code != 2:
        raise Crash(f"exit {code}: {err[-300:]!r}")
    _named(err, {"CHECKPOINT", "OUT_DIR", *KEYS, *LOCATION_KEYS})
    if "CHECKPOINT=" in err and str(workdir / "run") not in err:
        raise Crash(f"refusal does not name the checkpoint: {err[:300]!r}")
    return "refused"


# --- a pretrained directory's config.json ------------------------------------------------------

LLAMA_CONFIG = json.loads((HERE / "assets" / "Meta-Llama-3-8B-Instruct" / "config.json").read_text())
HF_EDITS = st.one_of(
    JSON_EDITS,
    st.lists(
        st.tuples(st.sampled_from(sorted(LLAMA_CONFIG)).map(lambda k: [k]), st.just("set"), _small_int),
        min_size=1,
        max_size=3,
    ).map(lambda e: ("edits", e)),
)


def run_hf_config(case, workdir: Path) -> str:
    model = workdir / "model"
    model.mkdir()
    (model / "config.json").write_bytes(_fuzzed_json(case, LLAMA_CONFIG))
    (model / "model.safetensors").write_bytes(b"")
    before = _digest(model)
    code, err = _cli(["check", "--set", f"model.pretrained={model}"])
    if _digest(model) != before:
        raise Crash("the pretrained directory changed")
    if code == 0:
        return "accepted"
    if code != 2:
        raise Crash(f"exit {code}: {err[-300:]!r}")
    _named(err, {*KEYS, *LOCATION_KEYS})
    if str(model) not in err and "config.json" not in err and "model." not in err.splitlines()[0]:
        raise Crash(f"refusal names neither the directory nor a model key: {err[:300]!r}")
    return "refused"


# --- the targets, and the runner the suite and the benchmark share -----------------------------

TARGETS = {
    "set_values": (SET_VALUES, run_set_values),
    "config_file": (CONFIG_FILES, run_config_file),
    "chat_rows": (CHAT_ROWS, run_chat_rows),
    "jsonl_rows": (JSONL_ROWS, run_jsonl_rows),
    "manifest": (MANIFEST_EDITS, run_manifest),
    "hf_config": (HF_EDITS, run_hf_config),
    "long_values": (LONG_VALUES, run_long_values),
    "deep_files": (DEEP_FILES, run_deep_files),
    "resume_files": (RESUME_FILES, run_resume_files),
}


def _huge_degree(override: str) -> bool:
    key, _, value = override.partition("=")
    return (
        key.strip() in ("parallelism.dp", "parallelism.tp", "parallelism.pp")
        and value.strip().isdigit()
        and (int(value) > 4096)
    )


def known_crash(target: str, case) -> str | None:
    """Where a case falls in a class of crashes already found and not fixed yet; None otherwise.
    The suite's examples skip these; the benchmark counts them as crashes all the same."""
    if target == "set_values" and any(_huge_degree(o) for o in case):
        return "cli check (distributed/parallel_dims.py): a valid huge world size lists every rank's groups (hangs)"
    return None


def run_case(target: str, case) -> str:
    """One case of ``target`` in a fresh directory (HF_HUB_OFFLINE: nothing reaches the network)."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        return TARGETS[target][1](case, Path(tmp))
