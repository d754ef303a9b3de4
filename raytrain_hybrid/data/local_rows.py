"""The run's input read in this process, without Ray Data (a `torchrun` launch).

``LocalRows`` has the one method the streams call on a Ray Data iterator
(``iter_batches(batch_size=, batch_format=)``) and yields the same rows in the same order as
data.ray_data's datasets with ``preserve_order``: the Parquet files in path order, each file's
rows in order, in the same form (data.forms: tokenized text, a classifier's encoded rows, chat
examples). Only the replica leaders read, as under Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.forms import row_form


class LocalRows:
    """``tables()``: a new pass over the rows (an epoch), as pyarrow tables, or as dicts of numpy
    arrays (a classifier's encoded rows, which data.sources.LabelledRows reads as numpy)."""

    def __init__(self, tables: Callable[[], Iterator]) -> None:
        self._tables = tables

    def iter_batches(self, batch_size: int = 256, batch_format: str = "pyarrow") -> Iterator:
        for table in self._tables():
            if isinstance(table, dict):
                rows = len(next(iter(table.values())))
                yield from ({k: v[i : i + batch_size] for k, v in table.items()} for i in range(0, rows, batch_size))
                continue
            for start in range(0, table.num_rows, batch_size):
                yield table.slice(start, batch_size)


def _files(path: str, columns: list[str], paths: bool) -> Iterator[pa.Table]:
    """Each file's rows of ``columns`` (with its path, if ``paths``), file by file in path order
    (Ray Data's read_parquet sorts the files it lists by path too)."""
    import pyarrow.dataset as pads

    dataset = pads.dataset(path, format="parquet")
    for fragment in sorted(dataset.get_fragments(), key=lambda f: f.path):
        table = fragment.to_table(columns=columns)
        if paths:
            table = table.append_column("path", pa.array([fragment.path] * table.num_rows, type=pa.string()))
        yield table


def train_rows(cfg: Config) -> LocalRows:
    """data.path's rows as data.ray_data.build_dataset gives them to the streams."""
    return rows_of(cfg, cfg.data.path)


def rows_of(cfg: Config, path: str) -> LocalRows:
    """The rows of ``path`` in data.forms' form (a classifier's labelled rows for data.val_path)."""
    form = row_form(cfg)

    def rows() -> Iterator:
        for table in _files(path, list(form.columns), form.paths):
            if form.batch_format == "numpy":  # as Ray Data hands a numpy batch: the columns' arrays
                table = {c: table.column(c).to_numpy(zero_copy_only=False) for c in form.columns}
            yield table if form.encode is None else form.encode(table)

    return LocalRows(rows)


def documents(docs: list[np.ndarray]) -> LocalRows:
    """Documents of token ids held in memory, as one "input_ids" column (the shipped corpus
    packed, without Ray)."""
    table = pa.table({"input_ids": pa.array([d.tolist() for d in docs], type=pa.list_(pa.int64()))})
    return LocalRows(lambda: iter([table]))


def builtin_corpus(cfg: Config) -> LocalRows:
    """The shipped corpus tokenized here, as prepare-data would write it (data.path="builtin"
    before its first preparation, which needs Ray): one document a row, in the corpus's order."""
    from raytrain_hybrid.data.prepare import _split_documents, tokenize_batch
    from raytrain_hybrid.data.tokenizer import DEFAULT_CORPUS, end_of_text, resolve_tokenizer

    docs = _split_documents({"bytes": DEFAULT_CORPUS.read_bytes()})
    table = pa.table({"text": [doc["text"] for doc in docs]})
    ids = tokenize_batch(table, text_column="text", tokenizer=resolve_tokenizer(cfg), eos=end_of_text(cfg))
    return LocalRows(lambda: iter([ids]))
