"""The input check of chat / prompt_completion data (data.format), before any worker starts.

Every row is encoded here once, as Ray Data's tasks will encode it (data.chat), so that what
would stop or silently change the run is known up front and said once: a missing or mistyped
column, a tokenizer without a chat template or larger than the model's vocabulary, a row with
an unknown role or no assistant turn, prompts that leave no answer token in the window (refused
unless data.drop_long_prompts), and how many rows are cut or dropped. For a data set of a
fine-tuning's usual size (tens of thousands of conversations) this is seconds of the driver's time.
"""

from __future__ import annotations

import os

import pyarrow as pa

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.files import columns_fix, open_parquet
from raytrain_hybrid.errors import ConfigError

# Data sets up to this many rows are checked in the driver's process, larger ones by Ray Data's
# tasks; RAYTRAIN_HYBRID_CHECK_ROWS sets another bound (0: always Ray Data, when Ray is up).
IN_PROCESS_ROWS = 5000


def check_examples(cfg: Config, say=print, *, encode_here: bool = True) -> int | None:
    """Returns the number of rows that train (``say`` gets a warning if rows are cut or dropped).
    ``encode_here=False``: a data set over the in-process bound has its columns and tokenizer
    checked, and None is returned (its rows are encoded once Ray is up)."""
    from raytrain_hybrid.data.chat import ExampleReport, ExampleSpec, RowError

    d = cfg.data
    _, files = check_hf_tokenizer(cfg)
    spec = ExampleSpec.of(cfg, files)
    dataset = open_parquet("data.path", d.path)
    _check_columns(spec, dataset.schema, d.path)
    if not encode_here and dataset.count_rows() > int(os.environ.get("RAYTRAIN_HYBRID_CHECK_ROWS", IN_PROCESS_ROWS)):
        return None
    report = ExampleReport()
    try:
        for outcomes in _outcomes(dataset, spec, d.path):
            report.add(outcomes)
    except RowError as exc:
        column = dict(zip(spec.keys, spec.columns, strict=True)).get(exc.key, d.format)
        raise ConfigError(exc.key, column, f"{exc} (data.path={d.path})") from exc
    if report.rows == 0:
        raise ConfigError("data.path", d.path, "has no rows")
    window = cfg.model.seq_len
    if report.long_prompts and not d.drop_long_prompts:
        what = "the prompt" if d.format == "prompt_completion" else "everything before the first assistant turn"
        raise ConfigError(
            "model.seq_len",
            window,
            f"{report.long_prompts} of {report.rows} rows of data.path (the first: row {report.first_long}) are "
            f"longer than model.seq_len in {what} (the longest {report.longest_prompt} tokens), so no token the "
            f"loss counts would remain; raise model.seq_len to at least {report.longest_prompt}, or set "
            "data.drop_long_prompts=true to drop those rows",
        )
    if report.trained < cfg.train.global_batch_size:
        raise ConfigError(
            "data.path",
            d.path,
            f"has {report.trained} rows to train on, fewer than train.global_batch_size={cfg.train.global_batch_size}",
        )
    _check_packed(cfg, report)
    notes = []
    if report.cut:
        notes.append(
            f"{report.cut} of {report.rows} rows are longer than model.seq_len+1={window + 1} tokens and are cut "
            "to it (the loss counts what remains)"
        )
    if report.long_prompts:
        notes.append(
            f"{report.long_prompts} rows are dropped: no token to train on fits in model.seq_len={window} "
            "(data.drop_long_prompts=true)"
        )
    if notes:
        say(f"warning: data.format={d.format}: " + "; ".join(notes))
    return report.trained


def _check_packed(cfg: Config, report) -> None:
    """With data.packing, the rows must fill one global batch of sequences (in their stored
    order; the shuffle moves the count by a row or so)."""
    from raytrain_hybrid.data.packing import packed_rows

    if not cfg.data.packing:
        return
    width, gb = cfg.model.seq_len + 1, cfg.train.global_batch_size
    rows = packed_rows(report.lengths, width)
    if rows < gb:
        raise ConfigError(
            "train.global_batch_size",
            gb,
            f"with data.packing=true the {report.trained} rows of data.path pack into {rows} sequences of "
            f"model.seq_len+1={width} tokens, fewer than one global batch; lower train.global_batch_size "
            f"(to at most {rows}, a multiple of dp*microbatches) or model.seq_len, or train on more rows",
        )


def _outcomes(dataset, spec, path: str):
    """Every row's outcome (data.chat.row_outcomes), batch by batch in the stored order: in this
    process for a small data set, else in Ray Data's tasks on the cluster (the driver's one core
    takes about 2 ms a conversation; Ray Data's executor starts in seconds)."""
    import ray

    from raytrain_hybrid.data.chat import row_outcomes

    bound = int(os.environ.get("RAYTRAIN_HYBRID_CHECK_ROWS", IN_PROCESS_ROWS))
    if dataset.count_rows() <= bound or not ray.is_initialized():
        for batch in dataset.to_batches(columns=list(spec.columns), batch_size=1024):
            yield row_outcomes(pa.Table.from_batches([batch]), spec=spec)
        return
    import ray.data

    ds = ray.data.read_parquet(path).select_columns(list(spec.columns))
    ds = ds.map_batches(row_outcomes, fn_kwargs={"spec": spec}, batch_format="pyarrow", batch_size=256)
    ds.context.execution_options.preserve_order = True  # the row numbers in the messages
    yield from ds.iter_batches(batch_size=4096, batch_format="pyarrow")


def _check_columns(spec, schema: pa.Schema, path: str) -> None:
    for key, column in zip(spec.keys, spec.columns, strict=True):
        if column not in schema.names:
            raise ConfigError(key, column, columns_fix(schema.names, path))
        kind = schema.field(column).type
        if spec.format == "chat":
            ok, want = pa.types.is_list(kind) or pa.types.is_large_list(kind), "a list of {role, content} messages"
        else:
            ok, want = pa.types.is_string(kind) or pa.types.is_large_string(kind), "text"
        if not ok:
            raise ConfigError(key, column, f"has type {kind} in {path}, not {want}")


def check_hf_tokenizer(cfg: Config):
    """The tokenizer the examples are encoded with, and its files: it loads, it fits
    model.vocab_size, and for data.format=chat it has a chat template."""
    from raytrain_hybrid.data.tokenizer import TokenizerFiles, load_hf_tokenizer, tokenizer_source

    source = tokenizer_source(cfg)
    shown = source or "(the shipped BPE)"
    key = "data.tokenizer" if cfg.data.tokenizer or not source else "model.pretrained"
    try:
        files = TokenizerFiles.read(source)
        tok = load_hf_tokenizer(files)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a directory without one
        raise ConfigError(
            key, shown, f"is not a usable tokenizer (tokenizer.json, tokenizer_config.json): {exc}"
        ) from exc
    if len(tok) > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"does not cover the tokenizer {shown} ({len(tok)} tokens with its added ones); set model.vocab_size "
            f">= {len(tok)} (with tp > 1 a multiple of tp)",
        )
    if cfg.data.format == "chat" and not tok.chat_template:
        raise ConfigError(
            "data.format",
            "chat",
            f"needs a tokenizer with a chat template, and {shown} has none: set model.pretrained (or "
            "data.tokenizer) to a directory whose tokenizer_config.json or chat_template.jinja holds one, or "
            "use data.format=prompt_completion",
        )
    return tok, files
