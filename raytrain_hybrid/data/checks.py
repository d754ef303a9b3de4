"""Checks of the input files before any worker starts: Parquet footers, columns, types, tokenizer."""

from __future__ import annotations

import pyarrow as pa

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.files import columns_fix, open_parquet


def schema_check(cfg: Config, say=print, *, encode_here: bool = True) -> int | None:
    """Before any worker starts: the files open, the column exists with the right type, rows exist.

    Returns the number of rows. Reads only Parquet footers, but for chat / prompt_completion
    data (data.format), whose rows are all encoded here once (check_examples; ``say`` gets the
    one warning about rows cut or dropped). ``encode_here=False`` (before Ray starts): rows too
    many to encode in this process are left for Ray Data's tasks, None returned.
    """
    from raytrain_hybrid.errors import ConfigError

    d = cfg.data
    if d.format != "text":
        from raytrain_hybrid.data.example_checks import check_examples

        return check_examples(cfg, say, encode_here=encode_here)
    if d.text_columns:
        rows = _rows_schema_check(cfg, "data.path", d.path)
        if d.val_path:
            _rows_schema_check(cfg, "data.val_path", d.val_path)
        check_tokenizer(cfg)
        return rows
    dataset = open_parquet("data.path", d.path)
    rows = 0
    # Each file through the dataset's own filesystem: its paths carry no scheme (an object
    # store's read "bucket/key"), so they cannot be opened again on their own.
    for fragment in dataset.get_fragments():
        f = fragment.path
        try:
            schema = fragment.physical_schema
            rows += fragment.count_rows()
        except (OSError, pa.ArrowInvalid) as exc:
            raise ConfigError("data.path", f, f"is not a readable Parquet file: {exc}") from exc
        key, column = ("data.text_column", d.text_column) if d.text_column else ("data.token_column", d.token_column)
        if column not in schema.names:
            raise ConfigError(key, column, columns_fix(schema.names, f))
        kind = schema.field(column).type
        if d.text_column and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(key, column, f"has type {kind} in {f}, not text; use data.token_column for token ids")
        # text_column wins when set: token_column keeps its default then and must not be checked.
        if not d.text_column and not (
            (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)
        ):
            raise ConfigError(key, column, f"has type {kind} in {f}, not a list of integer token ids")
    if rows == 0:
        raise ConfigError("data.path", d.path, "has no rows")
    if d.text_column:
        check_tokenizer(cfg)
    else:
        from raytrain_hybrid.data.prepare import unfinished_output

        note = unfinished_output(d.path, schema.names)
        if note:
            say(note)
    return rows


def check_tokenizer(cfg: Config) -> None:
    """Text is tokenized in Ray Data's tasks: a missing tokenizer, or one whose ids do not fit
    the model's embedding, must stop the run here rather than in a worker."""
    from raytrain_hybrid.data.tokenizer import classifier_tokenizer, load_tokenizer, resolve_tokenizer, tokenizer_source
    from raytrain_hybrid.errors import ConfigError
    from raytrain_hybrid.models.pretrained import read_config

    classifier = bool(cfg.data.text_columns)
    path = classifier_tokenizer(cfg) if classifier else resolve_tokenizer(cfg)
    shown = cfg.data.tokenizer or (path if classifier else "(the shipped BPE)")
    if not classifier and not cfg.data.tokenizer and tokenizer_source(cfg):  # model.pretrained's
        shown = path
    try:
        size = load_tokenizer(path).get_vocab_size()
    except FileNotFoundError as exc:
        raise ConfigError("data.tokenizer", shown, "does not exist; give a local tokenizer.json") from exc
    except Exception as exc:  # tokenizers raises its own error types for a malformed file
        raise ConfigError("data.tokenizer", shown, f"is not a usable tokenizer.json: {exc}") from exc
    if size > cfg.model.vocab_size:
        own = classifier and read_config(cfg.model.pretrained)
        raise ConfigError(
            "data.tokenizer",
            shown,
            f"has {size} tokens, more than model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {size}"
            + (" (or use the checkpoint's own tokenizer)" if own else ""),
        )


def _rows_schema_check(cfg: Config, key: str, path: str) -> int:
    """A classifier's Parquet: the text, numeric and label columns exist with usable types."""
    from raytrain_hybrid.errors import ConfigError

    d = cfg.data
    dataset = open_parquet(key, path)
    schema = dataset.schema
    kinds = [
        ("data.text_columns", d.text_columns, lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "text"),
        (
            "data.tabular_columns",
            d.tabular_columns,
            lambda t: pa.types.is_integer(t) or pa.types.is_floating(t),
            "numeric",
        ),
        ("data.label_column", [d.label_column], pa.types.is_integer, "integer"),
    ]
    for field_key, columns, ok, what in kinds:
        for column in columns:
            if column not in schema.names:
                raise ConfigError(field_key, column, columns_fix(schema.names, path))
            if not ok(schema.field(column).type):
                raise ConfigError(field_key, column, f"has type {schema.field(column).type} in {path}, not {what}")
    rows = dataset.count_rows()
    if key == "data.path" and rows < cfg.train.global_batch_size:
        raise ConfigError(
            key, path, f"has {rows} rows, fewer than train.global_batch_size={cfg.train.global_batch_size}"
        )
    if rows == 0:
        raise ConfigError(key, path, "has no rows")
    return rows
