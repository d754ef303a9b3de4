"""What a replica stream (data.stream.ReplicaStream) reads: its source of examples.

A source knows one kind of stored item and what a row of a global batch is made of; the stream
does the rest, once for every kind (the epochs, the seeded shuffle, the global batches, the
replica's share, the skip of a resumed run, the position). A source has:

- ``items()``: one pass over the stored items in the stored order (a Ray DataIterator's, or
  data.local_rows' for a run without Ray): documents of token ids, chat examples, labelled rows;
- ``rows(items)``: one epoch's rows from its items as the stream shuffled them, each checked;
- ``arrays(rows)``: a replica's share of a global batch as its leader broadcasts it;
- ``whole_epochs``: a global batch holds one epoch's rows and the epoch's last rows that fill
  none are dropped (when False, windows run on into the next epoch's global batch);
- ``unit``: what the rows are called when an epoch fills no global batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from raytrain_hybrid.data.packing import document_pieces, pack, rows_arrays
from raytrain_hybrid.data.rows import check_labels


class Source(Protocol):
    whole_epochs: bool
    unit: str

    def items(self) -> Iterator: ...

    def rows(self, items: Iterable) -> Iterator: ...

    def arrays(self, rows: list) -> np.ndarray | dict[str, np.ndarray]: ...


def _check_ids(ids: np.ndarray, vocab_size: int, where: str, fix: str) -> None:
    if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
        bad = int(ids.max() if ids.max() >= vocab_size else ids.min())
        raise ValueError(f"token id {bad} in {where} is outside [0, model.vocab_size={vocab_size}); {fix}")


def _paths(batch) -> list[str]:
    return batch.column("path").to_pylist() if "path" in batch.column_names else [""] * len(batch)


@dataclass
class TokenDocuments:
    """A language model's documents of token ids, cut into windows of ``seq_len + 1`` tokens
    that run on from one document into the next (the tail shorter than a window is carried into
    no window), or with ``packing`` cut into pieces and packed whole (data.packing)."""

    iterator: object  # a DataIterator over rows with a token column (and "path")
    token_column: str
    seq_len: int
    vocab_size: int
    packing: bool = False
    unit: str = "rows once packed"

    @property
    def whole_epochs(self) -> bool:
        return self.packing

    def items(self) -> Iterator[tuple[np.ndarray, str]]:
        for batch in self.iterator.iter_batches(batch_size=64, batch_format="pyarrow"):
            paths = _paths(batch)
            for i, ids in enumerate(batch.column(self.token_column).to_pylist()):
                yield np.asarray(ids, dtype=np.int64), paths[i]

    def _checked(self, items: Iterable[tuple[np.ndarray, str]]) -> Iterator[np.ndarray]:
        any_rows = False
        for ids, path in items:
            any_rows = True
            where = f"column {self.token_column!r} of {path or 'the dataset'}"
            _check_ids(ids, self.vocab_size, where, "raise model.vocab_size or re-tokenize")
            yield ids
        if not any_rows:
            raise ValueError("the dataset is empty: no rows to train on (data.path)")

    def rows(self, items: Iterable[tuple[np.ndarray, str]]) -> Iterator:
        width = self.seq_len + 1
        if self.packing:
            yield from pack((piece for ids in self._checked(items) for piece in document_pieces(ids, width)), width)
            return
        buffer: list[np.ndarray] = []
        held = total = windows = 0
        for ids in self._checked(items):
            buffer.append(ids)
            held += ids.size
            total += ids.size
            if held >= width:
                flat = np.concatenate(buffer)
                n = flat.size // width
                windows += n
                yield from flat[: n * width].reshape(n, width)
                rest = flat[n * width :]
                buffer, held = [rest], rest.size
        if not windows:  # every epoch would be as empty: with data.epochs=0 the run would wait forever
            raise ValueError(
                f"the dataset holds {total} tokens, fewer than one row of model.seq_len+1={width}: "
                "no step can run (data.path); lower model.seq_len or give more data"
            )

    def arrays(self, rows: list) -> np.ndarray | dict[str, np.ndarray]:
        """[rows, seq_len+1] int64 (packed: tokens, label_mask and positions, packing.rows_arrays)."""
        return rows_arrays(rows, True) if self.packing else np.stack(rows)


@dataclass
class Examples:
    """Chat and prompt/completion examples (data.format), encoded (``input_ids``,
    ``label_mask``; data.chat). Each example fills one row of ``seq_len + 1`` tokens, cut to it
    and padded at the end with id 0 and mask 0 (padding is never counted, and under causal
    attention no counted position sees it, so any id will do); with ``packing`` a row holds
    several whole examples instead (data.packing)."""

    iterator: object  # a DataIterator over rows with input_ids, label_mask (and "path")
    seq_len: int
    vocab_size: int
    packing: bool = False
    whole_epochs: bool = True

    @property
    def unit(self) -> str:
        return "rows once packed" if self.packing else "examples"

    def items(self) -> Iterator[tuple[np.ndarray, np.ndarray, str]]:
        for batch in self.iterator.iter_batches(batch_size=64, batch_format="pyarrow"):
            ids, masks = batch.column("input_ids").to_pylist(), batch.column("label_mask").to_pylist()
            for row, mask, path in zip(ids, masks, _paths(batch), strict=True):
                yield np.asarray(row, dtype=np.int64), np.asarray(mask, dtype=np.int64), path

    def _checked(self, items: Iterable[tuple[np.ndarray, np.ndarray, str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        width = self.seq_len + 1
        for ids, mask, path in items:
            _check_ids(ids, self.vocab_size, path or "the dataset", "raise model.vocab_size to cover the tokenizer")
            yield ids[:width], mask[:width]

    def _padded(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        width = self.seq_len + 1
        tokens = np.zeros(width, dtype=np.int64)
        counted = np.zeros(width, dtype=np.int64)
        tokens[: ids.size], counted[: mask.size] = ids, mask
        return tokens, counted, None

    def rows(self, items: Iterable) -> Iterator:
        examples = self._checked(items)
        return pack(examples, self.seq_len + 1) if self.packing else (self._padded(*e) for e in examples)

    def arrays(self, rows: list) -> dict[str, np.ndarray]:
        """tokens, label_mask (and positions when packed): [rows, seq_len+1] each."""
        return rows_arrays(rows, self.packing)


@dataclass
class LabelledRows:
    """A classifier's labelled rows, encoded (data.rows.encode) by Ray Data's tasks or here."""

    iterator: object  # a DataIterator over the encoded columns, read as numpy
    num_classes: int
    whole_epochs: bool = True
    unit: str = "rows"

    def items(self) -> Iterator[dict]:
        for batch in self.iterator.iter_batches(batch_size=256, batch_format="numpy"):
            check_labels(np.asarray(batch["label"]), self.num_classes, "data.path")
            columns = {k: np.asarray(v) for k, v in batch.items()}
            for i in range(len(columns["label"])):
                yield {k: v[i] for k, v in columns.items()}

    def rows(self, items: Iterable[dict]) -> Iterable[dict]:
        return items

    def arrays(self, rows: list[dict]) -> dict[str, np.ndarray]:
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
