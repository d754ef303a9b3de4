"""Fuzzing targets for what users hand the trainer (tests/test_fuzz.py, benchmarks/bench_fuzz.py):
``--set`` values, config files, chat / prompt-completion Parquet rows and JSONL given as data.

A target is a hypothesis strategy and a runner ``run_<target>(case, workdir)`` that returns
"accepted" or "refused" and raises on anything else (a crash): a refusal must be exit 2 (or a
ConfigError) naming a key or the file, with no traceback, and the user's files unchanged.
The file targets (manifests, a pretrained config.json) and the table of targets are in
tests/fuzz_files.py.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import math
import re
import tempfile
import typing
from pathlib import Path

from hypothesis import strategies as st

from raytrain_hybrid import cli
from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError

HERE = Path(__file__).resolve().parent
SECTIONS = {name: typing.get_type_hints(cls) for name, cls in typing.get_type_hints(Config).items()}
# Keys that open a location (a file, a URI, a Ray cluster): fuzzed with values that cannot reach
# the network (the check must not wait on DNS), the rest with anything.
LOCATION_KEYS = {
    "cluster.address",
    "model.pretrained",
    "data.path",
    "data.val_path",
    "data.tokenizer",
    "run.output_dir",
    "model.pretrained_revision",
}
KEYS = sorted(f"{s}.{k}" for s, hints in SECTIONS.items() for k in hints if f"{s}.{k}" not in LOCATION_KEYS)
SPECIAL = ["", "nan", "inf", "-inf", "+inf", "NaN", "1e999", "-1", "0", "1", "3", "1e-3", "0x10", "true", "no"]
SPECIAL += ["none", "auto", "[]", "[1,2]", "a,b", "[", "'", '"', "\\", "=", "s3://K:S@b/x", "\x00", "💥", "1_000"]
SPECIAL += [str(2**63 - 1), str(10**30), "65536", "4096"]
# Only what refuses before opening: a missing local path, credentials, an unknown scheme.
LOCATIONS = ["", "none", "/nonexistent/raytrain-fuzz", "s3://KEY:SECRET@bucket/x", "nosuchscheme://x/y", "./"]


class Crash(AssertionError):
    """A case that did not end accepted or clearly refused."""


def _text(max_size: int = 12):
    return st.text(st.characters(codec="utf-8"), max_size=max_size)


def _cli(argv: list[str]) -> tuple[int, str]:
    """cli.main as a user runs it: its exit code and what it wrote to stderr (an exception out of
    it is the traceback a user would see: it propagates, and the case is a crash)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's own refusal (a --set value that looks like a flag)
            code = exc.code
    return code, err.getvalue()


def _named(err: str, names: set[str]) -> None:
    """A refusal's first line is ``error: KEY=...`` with KEY a config key, a given key or a file."""
    usage = re.search(r"(?m)^\S+ \S+: error: argument (-[-\w]+)", err)  # argparse's: "prog cmd: error: argument --set"
    if usage and usage.group(1) in names and "Traceback" not in err:
        return
    start = re.search(r"(?m)^error: ", err)  # (a library's warning may come first)
    if start is None or "Traceback" in err:
        raise Crash(f"unclear refusal: {err[-500:]!r}")
    said = err[start.end() :]  # (a key may hold a newline: the whole text, not its first line)
    if several := re.match(r"\d+ mistakes in the config:\n  ", said):  # a config's mistakes at once: the first
        said = said[several.end() :]
    if not any(said.startswith(f"{n}=") for n in names):
        raise Crash(f"refusal names none of the keys or files: {err[:300]!r}")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_file():
            h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


# --- --set values and config files -------------------------------------------------------------

_value = st.one_of(
    st.sampled_from(SPECIAL),
    _text(),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
_key = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k + "x"),
    st.builds(lambda s, k: f"{s}.{k}", st.sampled_from(sorted(SECTIONS)), _text(8)),
    _text(10),
)
_override = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", _key, _value),
    # (cluster.address left out: any value is a cluster check joins)
    st.builds(
        lambda k, v: f"{k}={v}",
        st.sampled_from(sorted(LOCATION_KEYS - {"cluster.address"})),
        st.sampled_from(LOCATIONS),
    ),
    _text(16),  # no "=" at all, or several
)
SET_VALUES = st.lists(_override, min_size=1, max_size=4)


def _given_keys(overrides: list[str]) -> set[str]:
    """What a refusal of these overrides may name: each key as given, its sections, the whole item."""
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    sections = {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)}
    return keys | sections | {o.strip() for o in overrides} | set(overrides)


def run_set_values(overrides: list[str], workdir: Path) -> str:
    argv = ["check"]
    for o in overrides:
        argv += ["--set", o]
    code, err = _cli(argv)
    if code == 0:
        return "accepted"
    if code != 2:
        raise Crash(f"exit {code}: {err[-300:]!r}")
    _named(err, {*KEYS, *LOCATION_KEYS, *_given_keys(overrides), "config file", "--world-size", "--set"})
    return "refused"


_toml_scalar = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    _text(),
    st.sampled_from(SPECIAL),
    st.datetimes(min_value=datetime.datetime(1900, 1, 1), max_value=datetime.datetime(2100, 1, 1)),
)
_toml_value = st.recursive(
    _toml_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["a", "b", "dp"]), inner)),
    max_leaves=6,
)
_section_body = st.dictionaries(
    st.one_of(st.sampled_from(sorted({k for h in SECTIONS.values() for k in h})), _text(6)), _toml_value, max_size=4
)
TOML_TREES = st.dictionaries(st.one_of(st.sampled_from(sorted(SECTIONS)), _text(6)), _section_body, max_size=3)
CONFIG_FILES = st.one_of(TOML_TREES, _text(60), st.binary(max_size=60))


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def toml_text(tree: dict) -> str:
    lines = []
    for section, body in tree.items():
        lines.append(f"[{_toml_key(section)}]")
        lines += [f"{_toml_key(k)} = {_toml(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def _paths(tree: dict, prefix: str = "") -> set[str]:
    """Every dotted key of a TOML tree, tables and the keys inside them (a table in an array is
    named as the array's key is: ``a.b`` for ``[[a]] b = ...``)."""
    out = set()
    for key, value in tree.items():
        out.add(prefix + key)
        for table in _tables(value):
            out |= _paths(table, f"{prefix}{key}.")
    return out


def _tables(value) -> list[dict]:
    if isinstance(value, dict):
        return [value]
    return [t for v in value for t in _tables(v)] if isinstance(value, list) else []


def run_config_file(case, workdir: Path) -> str:
    path = workdir / "run.toml"
    if isinstance(case, dict):
        path.write_text(toml_text(case), encoding="utf-8", errors="surrogatepass")
    elif isinstance(case, bytes):
        path.write_bytes(case)
    else:
        path.write_text(case, encoding="utf-8", errors="surrogatepass")
    before = _digest(path)
    code, err = _cli(["check", str(path)])
    if _digest(path) != before:
        raise Crash("the config file changed")
    if code == 0:
        return "accepted"
    if code != 2:
        raise Crash(f"exit {code}: {err[-300:]!r}")
    names = {*KEYS, *LOCATION_KEYS, "config file"}
    if isinstance(case, dict):  # a key of the file's own (a misspelt one, a section that is not one)
        names |= _paths(case)
    _named(err, names)
    return "refused"


# --- data rows: chat / prompt-completion Parquet, JSONL --------------------------------------

_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), _text(16), st.sampled_from(["", "user"]))
_role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "", "Assistant"]), _text(6))
_message = st.one_of(
    st.fixed_dictionaries({"role": _role, "content": st.one_of(_text(24), _json_scalar)}),
    st.dictionaries(st.sampled_from(["role", "content", "name", "weight"]), _json_scalar, max_size=3),
    _json_scalar,
    st.lists(_json_scalar, max_size=2),
)
_conversation = st.one_of(st.lists(_message, max_size=4), _json_scalar, st.dictionaries(_text(4), _json_scalar))
CHAT_ROWS = st.tuples(
    st.sampled_from(["chat", "prompt_completion"]),
    st.lists(_conversation, min_size=0, max_size=4),
    st.booleans(),  # data.drop_long_prompts
)


def _chat_tokenizer() -> Path:
    """A tokenizer with a chat template (tests/chat_data.py's), made once per process."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from chat_data import make_tokenizer

        _TOKENIZER = make_tokenizer(Path(tempfile.mkdtemp(prefix="fuzz-tok-")))
    return _TOKENIZER


_TOKENIZER: Path | None = None
DATA_BASE = [
    "parallelism.dp=1",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "parallelism.microbatches=1",
    "train.global_batch_size=1",
    "model.vocab_size=4104",
    "model.seq_len=32",
]


def _table(values: list, column: str):
    """The rows as one Parquet column: pyarrow's own type when it finds one, else each as text
    (a column a user's JSON-in-a-string export would give)."""
    import pyarrow as pa

    try:
        return pa.table({column: pa.array(values)})
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        return pa.table({column: pa.array([json.dumps(v, default=str) for v in values])})


def _check_data(overrides: list[str], files: list[Path]) -> str:
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.data.checks import schema_check

    before = [_digest(f) for f in files]
    try:
        cfg = load_config(None, overrides)
        schema_check(cfg, say=lambda line: None)
        outcome = "accepted"
    except ConfigError as exc:
        if not exc.key.startswith(("data.", "model.", "train.")) or not str(exc).startswith(f"{exc.key}="):
            raise Crash(f"refusal names no data, model or train key: {exc}") from exc
        outcome = "refused"
    if [_digest(f) for f in files] != before:
        raise Crash("a data file changed")
    return outcome


def run_chat_rows(case, workdir: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    fmt, rows, drop = case
    path = workdir / "rows.parquet"
    if fmt == "chat":
        table = _table(rows, "messages")
    else:  # the prompt and the completion from the first two parts of each row
        firsts = [r[0] if isinstance(r, list) and r else r for r in rows]
        table = pa.table({"prompt": _table(firsts, "p")["p"], "completion": _table(rows, "c")["c"]})
    try:
        pq.write_table(table, path)
    except pa.ArrowNotImplementedError:  # a type Parquet cannot hold (a struct without fields): as text
        pq.write_table(_table([json.dumps(v) for v in rows], table.column_names[0]), path)
    extra = [f"data.format={fmt}", f"data.path={path}", f"data.tokenizer={_chat_tokenizer()}"]
    return _check_data([*DATA_BASE, *extra, f"data.drop_long_prompts={drop}"], [path])


JSONL_ROWS = st.lists(st.one_of(st.builds(json.dumps, _conversation), _text(30)), max_size=5)


def run_jsonl_rows(lines: list[str], workdir: Path) -> str:
    path = workdir / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    extra = ["data.format=chat", f"data.path={path}", f"data.tokenizer={_chat_tokenizer()}"]
    return _check_data([*DATA_BASE, *extra], [path])
