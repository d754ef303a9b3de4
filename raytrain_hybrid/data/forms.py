"""How data.path's rows become what a replica stream's source reads (data.sources), said once for
both readers: Ray Data's tasks (data.ray_data) and this process without Ray (data.local_rows, a
`torchrun` launch or the engine alone). Each reads the form's columns from the Parquet files in
path order, keeps each row's file path where the source names it in its messages, and maps the
batches through the form's ``encode``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from raytrain_hybrid.config import Config


@dataclass(frozen=True)
class RowForm:
    columns: tuple[str, ...]  # read from the files
    paths: bool  # each row keeps its file's path (a "path" column)
    encode: Callable | None = None  # a batch of the columns (and "path") -> the source's rows; None: as read
    batch_format: str = "pyarrow"  # what ``encode`` takes: a pyarrow table, or "numpy" columns
    batch_size: int = 256


def row_form(cfg: Config) -> RowForm:
    """data.path's form: a classifier's labelled rows (data.text_columns), chat or prompt/completion
    examples (data.format), raw text to tokenize (data.text_column), or token ids as stored."""
    d = cfg.data
    if d.text_columns:  # resolve_defaults() fills text_columns for classifiers only
        from raytrain_hybrid.data.rows import encode, encoder_kwargs

        columns = (*d.text_columns, *d.tabular_columns, d.label_column)
        return RowForm(columns, False, functools.partial(encode, **encoder_kwargs(cfg)), "numpy", 256)
    if d.format != "text":  # one example a row, with its label mask
        from raytrain_hybrid.data.chat import ExampleSpec, encode_table

        spec = ExampleSpec.of(cfg)
        return RowForm(spec.columns, True, functools.partial(encode_table, spec=spec), "pyarrow", 64)
    if not d.text_column:  # token ids already
        return RowForm((d.token_column,), True)
    from raytrain_hybrid.data.tokenizer import end_of_text, resolve_tokenizer

    tokenize = functools.partial(
        _tokenized, text_column=d.text_column, tokenizer=resolve_tokenizer(cfg), eos=end_of_text(cfg)
    )
    return RowForm((d.text_column,), True, tokenize, "pyarrow", 256)


def _tokenized(batch: pa.Table, *, text_column: str, tokenizer: str, eos: str) -> pa.Table:
    from raytrain_hybrid.data.prepare import tokenize_batch

    ids = tokenize_batch(batch, text_column=text_column, tokenizer=tokenizer, eos=eos)
    return ids.append_column("path", batch.column("path"))
