"""``raytrain-hybrid prepare-data SOURCE OUT_DIR``: text or Parquet in, tokenized Parquet out.

Tokenization runs as a Ray Data ``map_batches`` over the source; the output
has one row per document with ``input_ids`` (list<int32>) and ``num_tokens``,
in the source's order, ready for ``data.token_column = "input_ids"``.
Text files hold documents separated by blank lines. ``data.path = "builtin"`` is the
shipped corpus prepared this way once, into a cache. SOURCE and OUT_DIR are local paths,
shared mounts or URIs (s3://, gs://) opened through raytrain_hybrid.storage: the shards are
written straight to OUT_DIR's filesystem, where ``data.path=<OUT_DIR>`` then reads them.

OUT_DIR must be new or empty, and ``_SUCCESS`` (JSON: rows, tokens, files) is written into it
last: a directory without it is an output that stopped part-way, which a re-run refuses (it
would add its rows beside the first run's) instead of mixing them. Readers of Parquet skip
names starting with ``_``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_hybrid.data.tokenizer import (
    EOT,
    end_of_text,
    eos_token,
    load_tokenizer,
    resolve_tokenizer,
    tokenizer_json,
)
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import Store, as_store, cache_dir, is_uri, open_store

TEXT_SUFFIXES = (".txt", ".text", ".md")
# Written into OUT_DIR last, with the output's counts: the output is whole.
MARKER = "_SUCCESS"


def _check_out_dir(out: Store) -> None:
    """OUT_DIR: new, or an empty directory; anything else refused naming it, before any work."""
    if out.is_file():
        raise ConfigError("prepare-data OUT_DIR", out.uri, "is a file; give a new directory")
    names = out.listdir()
    if not names:
        return
    if MARKER in names:
        what = "holds a finished prepare-data output already"
    elif any(n.endswith(".parquet") for n in names):
        what = f"holds an incomplete prepare-data output (no {MARKER}: a run that stopped part-way)"
    else:
        what = "is not empty"
    raise ConfigError(
        "prepare-data OUT_DIR",
        out.uri,
        f"{what}; give a new directory, or delete this one first (writing beside its files would mix them)",
    )


def prepared_marker(path: str | Store) -> dict | None:
    """A prepare-data output's counts (its _SUCCESS), or None when it has none."""
    marker = as_store(path, "data.path").child(MARKER)
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (ValueError, UnicodeDecodeError):
        return None


def tokenize_batch(batch: pa.Table, *, text_column: str, tokenizer: str, eos: str = EOT) -> pa.Table:
    """One Ray Data batch of documents -> their token ids (``eos`` appended to each)."""
    tok = load_tokenizer(tokenizer)
    eot = tok.token_to_id(eos)
    texts = batch.column(text_column).to_pylist()
    ids = []
    for enc in tok.encode_batch([t or "" for t in texts]):
        ids.append(enc.ids + ([eot] if eot is not None else []))
    return pa.table(
        {
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "num_tokens": pa.array([len(i) for i in ids], type=pa.int32()),
        }
    )


def _split_documents(row: dict) -> list[dict]:
    text = row["bytes"].decode("utf-8")
    return [{"text": doc} for doc in text.split("\n\n") if doc.strip()]


def _expand(source: str) -> list[str]:
    if is_uri(source):
        if not open_store(source, "prepare-data SOURCE").exists():
            raise FileNotFoundError(f"prepare-data SOURCE {source!r} matches no file or directory")
        return [source]
    paths = sorted(glob.glob(source)) if any(c in source for c in "*?[") else [source]
    if not paths or not all(os.path.exists(p) for p in paths):
        raise FileNotFoundError(f"prepare-data SOURCE {source!r} matches no file or directory")
    return paths


def _is_text(paths: list[str]) -> bool:
    files = []
    for p in paths:
        store = open_store(p, "prepare-data SOURCE")
        if store.is_dir():
            infos = store.fs.get_file_info(pafs.FileSelector(store.path, recursive=True))
            files += [i.path for i in infos if i.type == pafs.FileType.File]
        else:
            files.append(store.path)
    return bool(files) and all(f.endswith(TEXT_SUFFIXES) for f in files)


def prepare_data(
    source: str,
    out_dir: str | os.PathLike | Store,
    *,
    text_column: str = "text",
    tokenizer: str = "",
    eos: str = "",
) -> dict:
    """Tokenize ``source`` into Parquet shards under ``out_dir`` (a directory or URI); returns
    the output's URI and its token count. ``tokenizer``: a tokenizer.json or a Hugging Face
    tokenizer directory; ``eos`` ends each document (default: the directory's eos_token, else EOT)."""
    import ray
    import ray.data

    out = as_store(out_dir, "prepare-data OUT_DIR")
    _check_out_dir(out)
    if not eos:
        eos = eos_token(tokenizer) if tokenizer and Path(tokenizer).is_dir() else EOT
    tokenizer = tokenizer_json(tokenizer)
    load_tokenizer(tokenizer)  # fail here, not in a Ray task, on a bad path
    paths = _expand(source)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # output rows keep the source's order
    if _is_text(paths):
        ds = ray.data.read_binary_files(paths).flat_map(_split_documents)
        column = "text"
    else:
        ds = ray.data.read_parquet(paths, columns=[text_column])
        column = text_column
    ds = ds.map_batches(
        tokenize_batch,
        batch_format="pyarrow",
        batch_size=256,
        fn_kwargs={"text_column": column, "tokenizer": tokenizer, "eos": eos},
    )
    # The store's own filesystem, given explicitly: the same one a run's data.path resolves to.
    ds.write_parquet(out.path, filesystem=out.fs)
    written = ray.data.read_parquet(out.path, filesystem=out.fs, columns=["num_tokens"])
    tokens, rows = int(written.sum("num_tokens") or 0), written.count()
    files = sorted(n for n in out.listdir() if n.endswith(".parquet"))
    out.child(MARKER).write_text(json.dumps({"rows": rows, "tokens": tokens, "files": files}, indent=1) + "\n")
    return {"out_dir": out.uri, "tokens": tokens, "rows": rows}


def builtin_path(cfg) -> Path:
    """Where the shipped corpus is prepared for ``cfg``'s tokenizer: a cache named by what makes it,
    known before it is made (a run's plan names it before Ray starts)."""
    import hashlib

    from raytrain_hybrid.data.tokenizer import DEFAULT_CORPUS

    tokenizer, eos = resolve_tokenizer(cfg), end_of_text(cfg)
    # The output's format is part of the name: a cache made before prepare-data wrote its marker
    # is made again, not taken for an incomplete output.
    made = DEFAULT_CORPUS.read_bytes() + Path(tokenizer).read_bytes() + eos.encode() + MARKER.encode()
    return cache_dir() / f"builtin-{hashlib.sha256(made).hexdigest()[:16]}"


def builtin_dataset(cfg, make: bool = True) -> str | None:
    """The shipped corpus as token Parquet, prepared once per corpus+tokenizer into a cache
    (builtin_path; ``make=False``: None when it has not been prepared yet)."""
    from raytrain_hybrid.data.tokenizer import DEFAULT_CORPUS

    out = builtin_path(cfg)
    if not (out / MARKER).exists():
        if not make:
            return None
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        prepare_data(str(DEFAULT_CORPUS), str(tmp), tokenizer=resolve_tokenizer(cfg), eos=end_of_text(cfg))
        try:
            tmp.rename(out)
        except OSError:  # another process (a run, a test beside it) put its copy there first
            if not (out / MARKER).exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def unfinished_output(path: str, columns: list[str]) -> str | None:
    """A warning when ``path`` (data.path, a directory) holds prepare-data's columns but not its
    marker: an output whose prepare-data stopped part-way, missing rows. None otherwise."""
    if not {"input_ids", "num_tokens"} <= set(columns):
        return None
    try:
        store = as_store(path, "data.path")
        if not store.is_dir() or store.child(MARKER).exists():
            return None
    except (ConfigError, OSError, ValueError):  # a glob or a file list: not one output directory
        return None
    return (
        f"warning: data.path={path} holds prepare-data's columns but no {MARKER}: the prepare-data that "
        "wrote it may have stopped part-way (rows missing); prepare it again into a new directory"
    )
