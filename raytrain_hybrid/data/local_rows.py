"""The run's input read in this process, without Ray Data (a `torchrun` launch).

``LocalRows`` has the one method the streams call on a Ray Data iterator
(``iter_batches(batch_size=, batch_format=)``) and yields the same rows in the same order as
data.ray_data's datasets with ``preserve_order``: the Parquet files in path order, each file's
rows in order, mapped by the same functions (tokenized text,
a classifier's encoded rows, chat examples). Only the replica leaders read, as under Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa

from raytrain_hybrid.config import Config


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


def _files(path: str, columns: list[str]) -> Iterator[pa.Table]:
    """Each file's rows of ``columns`` with its path, file by file in path order (Ray Data's
    read_parquet sorts the files it lists by path too)."""
    import pyarrow.dataset as pads

    dataset = pads.dataset(path, format="parquet")
    for fragment in sorted(dataset.get_fragments(), key=lambda f: f.path):
        table = fragment.to_table(columns=columns)
        yield table.append_column("path", pa.array([fragment.path] * table.num_rows, type=pa.string()))


def train_rows(cfg: Config) -> LocalRows:
    """data.path's rows as data.ray_data.build_dataset gives them to the streams."""
    d = cfg.data
    if d.text_columns:  # a classifier's rows
        return rows_of(cfg, d.path)
    if d.format != "text":  # chat / prompt_completion: one example a row, with its label mask
        from raytrain_hybrid.data.chat import ExampleSpec, encode_table

        spec = ExampleSpec.of(cfg)
        return LocalRows(lambda: (encode_table(t, spec=spec) for t in _files(d.path, list(spec.columns))))
    if not d.text_column:  # token ids already
        return LocalRows(lambda: _files(d.path, [d.token_column]))
    from raytrain_hybrid.data.prepare import tokenize_batch
    from raytrain_hybrid.data.tokenizer import end_of_text, resolve_tokenizer

    tokenizer, eos = resolve_tokenizer(cfg), end_of_text(cfg)

    def tokenized() -> Iterator[pa.Table]:
        for t in _files(d.path, [d.text_column]):
            ids = tokenize_batch(t, text_column=d.text_column, tokenizer=tokenizer, eos=eos)
            yield ids.append_column("path", t.column("path"))

    return LocalRows(tokenized)


def rows_of(cfg: Config, path: str) -> LocalRows:
    """A classifier's labelled rows of ``path``, encoded (data.ray_data.build_rows_dataset)."""
    from raytrain_hybrid.data.rows import encode, encoder_kwargs

    d, kwargs = cfg.data, encoder_kwargs(cfg)
    columns = [*d.text_columns, *d.tabular_columns, d.label_column]

    def encoded() -> Iterator[dict]:
        for t in _files(path, columns):
            yield encode({c: t.column(c).to_numpy(zero_copy_only=False) for c in columns}, **kwargs)

    return LocalRows(encoded)


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
