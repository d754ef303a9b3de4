"""One replica's share of each global batch of examples (data.format chat / prompt_completion).

The rows come encoded (``input_ids``, ``label_mask``; data.chat) from Ray Data's tasks, or,
for the engine without Ray, encoded here from data.path read in this process: the same stream
either way. Each example fills one row of ``seq_len + 1`` tokens, padded at the end with id 0
and mask 0 (padding is never counted, and under causal attention no counted position sees
it, so any id will do); with data.packing a row holds several whole examples instead
(data.packing). The global batch of step k is the k-th run of ``global_batch_size`` rows of
the epoch's order (the stored order through the seeded shuffle buffer, as for text); replica r
keeps its r-th contiguous share. An epoch's last rows that do not fill a global batch are
dropped from that epoch (as for labelled rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from raytrain_hybrid.data.packing import DocumentIterator, corpus_documents, pack, rows_arrays
from raytrain_hybrid.data.stream import ReplicaStream, StreamPosition, shuffled, stream_args


@dataclass
class ExampleStream:
    iterator: object  # anything with iter_batches(batch_size=, batch_format="pyarrow"): a DataIterator
    seq_len: int
    vocab_size: int
    global_batch: int
    dp: int
    dp_rank: int
    seed: int
    epochs: int = 0
    shuffle_buffer: int = 0
    skip_steps: int = 0
    position: StreamPosition = field(default_factory=StreamPosition)
    packing: bool = False  # data.packing: several whole examples a row

    def _examples(self) -> Iterator[tuple[np.ndarray, np.ndarray, str]]:
        for batch in self.iterator.iter_batches(batch_size=64, batch_format="pyarrow"):
            ids, masks = batch.column("input_ids").to_pylist(), batch.column("label_mask").to_pylist()
            paths = batch.column("path").to_pylist() if "path" in batch.column_names else [""] * len(ids)
            for row, mask, path in zip(ids, masks, paths, strict=True):
                yield np.asarray(row, dtype=np.int64), np.asarray(mask, dtype=np.int64), path

    def _checked(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The epoch's examples in order, their ids checked, each cut to the window; counted."""
        width = self.seq_len + 1
        for ids, mask, path in shuffled(self._examples(), self.shuffle_buffer, self.seed + epoch):
            if ids.size and (ids.max() >= self.vocab_size or ids.min() < 0):
                bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
                raise ValueError(
                    f"token id {bad} in {path or 'the dataset'} is outside [0, model.vocab_size={self.vocab_size}); "
                    "raise model.vocab_size to cover the tokenizer"
                )
            self.position.documents_in_epoch += 1
            yield ids[:width], mask[:width]

    def _padded(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        width = self.seq_len + 1
        tokens = np.zeros(width, dtype=np.int64)  # padding: see the module docstring
        counted = np.zeros(width, dtype=np.int64)
        tokens[: ids.size], counted[: mask.size] = ids, mask
        return tokens, counted, None

    def __iter__(self) -> Iterator[dict]:
        """Yields {"tokens", "label_mask"[, "positions"]}: [rows, seq_len+1] arrays, one dict per step."""
        share = self.global_batch // self.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        epoch = 0
        while self.epochs == 0 or epoch < self.epochs:
            self.position.epoch, self.position.samples_in_epoch, self.position.documents_in_epoch = epoch, 0, 0
            examples = self._checked(epoch)
            rows = pack(examples, self.seq_len + 1) if self.packing else (self._padded(*e) for e in examples)
            held: list = []
            for row in rows:
                held.append(row)
                if len(held) < self.global_batch:
                    continue
                self.position.samples_in_epoch += self.global_batch
                if self.position.step_done(self.skip_steps):
                    yield rows_arrays(held[lo:hi], self.packing)
                held = []
            if self.position.samples_in_epoch == 0:
                what = "rows once packed" if self.packing else "examples"
                raise ValueError(
                    f"the dataset holds {len(held)} {what}, fewer than one global batch "
                    f"(train.global_batch_size={self.global_batch}): no step can run (data.path)"
                )
            epoch += 1


def _stream_args(cfg, dp: int, dp_rank: int) -> dict:
    """A replica's stream of token rows as the config shapes it (data.stream.stream_args, and the rows' shape)."""
    return {"seq_len": cfg.model.seq_len, "vocab_size": cfg.model.vocab_size, **stream_args(cfg, dp, dp_rank)}


def example_stream(cfg, iterator, *, dp: int, dp_rank: int, skip_steps: int = 0) -> ExampleStream:
    args = _stream_args(cfg, dp, dp_rank)
    return ExampleStream(iterator=iterator, skip_steps=skip_steps, packing=cfg.data.packing, **args)


class TableIterator:
    """data.path read and encoded in this process, iterated like a Ray DataIterator (the engine
    without Ray: gloo tests, a single GPU run)."""

    def __init__(self, cfg) -> None:
        import pyarrow.dataset as pads

        from raytrain_hybrid.data.chat import ExampleSpec, encode_table

        spec = ExampleSpec.of(cfg)
        table = pads.dataset(cfg.data.path, format="parquet").to_table(columns=list(spec.columns))
        self.table = encode_table(table, spec=spec)

    def iter_batches(self, batch_size: int, batch_format: str = "pyarrow"):
        assert batch_format == "pyarrow", batch_format
        for start in range(0, self.table.num_rows, batch_size):
            yield self.table.slice(start, batch_size)


def in_memory_examples(cfg, dp: int, dp_rank: int):
    """step -> this replica's batch (or None when data.epochs ran out), without Ray; raw text
    packed (data.packing): the shipped corpus's documents."""
    if cfg.data.format == "text":
        return in_memory_packed_text(cfg, dp, dp_rank)
    return stepper(example_stream(cfg, TableIterator(cfg), dp=dp, dp_rank=dp_rank))


def in_memory_packed_text(cfg, dp: int, dp_rank: int):
    """step -> this replica's batch (None when data.epochs ran out): the shipped corpus's
    documents, shuffled (data.shuffle_buffer, data.shuffle_seed) and packed, without Ray."""
    from raytrain_hybrid.data.corpus import tokenize_corpus
    from raytrain_hybrid.data.tokenizer import EOT, load_tokenizer

    eot = load_tokenizer(cfg.data.tokenizer).token_to_id(EOT)
    docs = corpus_documents(tokenize_corpus(tokenizer=cfg.data.tokenizer), eot)
    args = _stream_args(cfg, dp, dp_rank)
    return stepper(ReplicaStream(iterator=DocumentIterator(docs), token_column="input_ids", packing=True, **args))


def stepper(stream):
    """A stream of per-step arrays as ``step -> Batch`` (None once it ends), read in step order."""
    from raytrain_hybrid.data.rows import to_batch

    steps = iter(stream)
    done = 0

    def next_batch(step: int):
        nonlocal done
        arrays = None
        while done <= step:  # a resumed run asks for its first step first
            arrays, done = next(steps, None), done + 1
        return None if arrays is None else to_batch(arrays)

    return next_batch
