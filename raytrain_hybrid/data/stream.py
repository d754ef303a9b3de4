"""Training input through Ray Data, sharded along the DP axis only.

Why not Ray Train's default split: it gives every *worker* its own shard, but
all tp*pp ranks of a data-parallel replica must see the same rows. And a
streaming split hands blocks to whichever consumer asks first, so the rows a
replica gets would depend on timing and on dp, and the single-process oracle
would no longer hold.

What we do instead: the dataset is read in a fixed order (``preserve_order``), then
shuffled here through a buffer seeded per epoch (``shuffled``). One leader per replica (its
rank at pp=0, tp=0) iterates that stream, packs documents into windows of
``seq_len + 1`` tokens (short documents are packed, never dropped), cuts the
windows into global batches of ``global_batch_size`` and keeps its contiguous
share; it broadcasts the share to the other ranks of its replica. So the global
batch of step k is the same for every layout, each window is used once per epoch
across replicas, and only one rank per replica reads. The price: every replica
leader streams the whole dataset and drops the (dp-1)/dp it does not keep.

Why not Ray Data's ``local_shuffle_buffer_size``: its output depends on where the blocks
begin and end (it shuffles whatever whole blocks its buffer holds), and how a read is cut
into blocks depends on the CPUs of the placement group doing the read, so on the layout:
a resumed run at another layout would have trained on other documents.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from raytrain_hybrid.config import Config


def shuffled(items: Iterator, buffer: int, seed: int) -> Iterator:
    """``items`` through a shuffle buffer of ``buffer`` items (0: in order): once it is full, each
    new item takes the place of one drawn at random, which is yielded; the rest at the end in a
    random order. The result depends only on the items' order and the seed."""
    if buffer <= 0:
        yield from items
        return
    rng = np.random.default_rng(seed)
    held: list = []
    for item in items:
        if len(held) < buffer:
            held.append(item)
            continue
        j = int(rng.integers(buffer))
        yield held[j]
        held[j] = item
    for j in rng.permutation(len(held)):
        yield held[j]


@dataclass
class StreamPosition:
    """Where the stream is: enough to skip to the same place after a restart.

    A sample is what one row of a global batch holds: a window of seq_len+1 tokens for a
    language model (ReplicaStream), a labelled row for a classifier (RowStream).
    """

    epoch: int = 0
    samples_in_epoch: int = 0
    documents_in_epoch: int = 0
    steps: int = 0

    # Where the stream stood after the last step it skipped (a resumed run), as manifest_entry.
    skipped_to: dict | None = field(default=None, compare=False)

    def step_done(self, skip_steps: int) -> bool:
        """Count a global batch; True when it is one to train on, past the ``skip_steps`` a
        resumed run has done already (at the last of those, remember where the stream stood)."""
        self.steps += 1
        if self.steps == skip_steps:
            self.skipped_to = self.manifest_entry()
        return self.steps > skip_steps

    def manifest_entry(self) -> dict:
        """The checkpoint manifest's ``data_position``. Its keys predate the name "sample" (it
        was "window" for both kinds) and stay, so that every manifest reads alike."""
        return {
            "epoch": self.epoch,
            "windows_in_epoch": self.samples_in_epoch,
            "documents_in_epoch": self.documents_in_epoch,
            "steps": self.steps,
        }

    def metrics(self) -> dict:
        """The step's keys in metrics.jsonl (named as in the manifest)."""
        return {"data_epoch": self.epoch, "data_windows_in_epoch": self.samples_in_epoch}


@dataclass
class ReplicaStream:
    """One replica's share of each global batch, from a Ray Data iterator of documents."""

    iterator: object  # ray.data.DataIterator over rows with a token column (and "path")
    token_column: str
    seq_len: int
    vocab_size: int
    global_batch: int
    dp: int
    dp_rank: int
    seed: int
    epochs: int = 0  # 0: as many as the run needs
    shuffle_buffer: int = 0
    skip_steps: int = 0  # global batches already trained on (a resumed run)
    position: StreamPosition = field(default_factory=StreamPosition)
    packing: bool = False  # data.packing: whole documents in rows (data.packing), not a cut stream

    def _documents(self, epoch: int) -> Iterator[tuple[np.ndarray, str]]:
        def stored() -> Iterator[tuple[np.ndarray, str]]:
            for batch in self.iterator.iter_batches(batch_size=64, batch_format="pyarrow"):
                column = batch.column(self.token_column)
                paths = batch.column("path").to_pylist() if "path" in batch.column_names else [""] * len(batch)
                for i, ids in enumerate(column.to_pylist()):
                    yield np.asarray(ids, dtype=np.int64), paths[i]

        return shuffled(stored(), self.shuffle_buffer, self.seed + epoch)

    def _checked(self, epoch: int) -> Iterator[np.ndarray]:
        """The epoch's documents in order, their ids checked; counted."""
        any_rows = False
        for ids, path in self._documents(epoch):
            any_rows = True
            self.position.documents_in_epoch += 1
            if ids.size and (ids.max() >= self.vocab_size or ids.min() < 0):
                bad = int(ids.max() if ids.max() >= self.vocab_size else ids.min())
                raise ValueError(
                    f"token id {bad} in column {self.token_column!r} of {path or 'the dataset'} is outside "
                    f"[0, model.vocab_size={self.vocab_size}); raise model.vocab_size or re-tokenize"
                )
            yield ids
        if not any_rows:
            raise ValueError("the dataset is empty: no rows to train on (data.path)")

    def _windows(self) -> Iterator[np.ndarray]:
        width = self.seq_len + 1
        epoch = 0
        while self.epochs == 0 or epoch < self.epochs:
            buffer: list[np.ndarray] = []
            held = 0
            self.position.epoch, self.position.samples_in_epoch, self.position.documents_in_epoch = epoch, 0, 0
            for ids in self._checked(epoch):
                buffer.append(ids)
                held += ids.size
                if held >= width:
                    flat = np.concatenate(buffer)
                    n = flat.size // width
                    for w in flat[: n * width].reshape(n, width):
                        self.position.samples_in_epoch += 1
                        yield w
                    rest = flat[n * width :]
                    buffer, held = [rest], rest.size
            epoch += 1  # the tail shorter than one window is carried into no window

    def _packed(self) -> Iterator[tuple]:
        from raytrain_hybrid.data.packing import document_pieces, pack

        width = self.seq_len + 1
        epoch = 0
        while self.epochs == 0 or epoch < self.epochs:
            self.position.epoch, self.position.samples_in_epoch, self.position.documents_in_epoch = epoch, 0, 0
            pieces = (piece for ids in self._checked(epoch) for piece in document_pieces(ids, width))
            for row in pack(pieces, width):
                self.position.samples_in_epoch += 1
                yield row
            if self.position.samples_in_epoch < self.global_batch:
                raise ValueError(
                    f"the dataset holds {self.position.samples_in_epoch} rows once packed, fewer than one global batch "
                    f"(train.global_batch_size={self.global_batch}): no step can run (data.path)"
                )
            epoch += 1  # the epoch's last rows that fill no global batch are dropped

    def __iter__(self) -> Iterator[np.ndarray | dict]:
        """Yields [global_batch/dp, seq_len+1] int64 arrays, one per step (packed: a dict of
        tokens, label_mask and positions, data.packing.rows_arrays)."""
        from raytrain_hybrid.data.packing import rows_arrays

        share = self.global_batch // self.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        batch: list = []
        epoch = -1
        for window in self._packed() if self.packing else self._windows():
            if self.packing and epoch != self.position.epoch:  # a global batch holds one epoch's rows
                batch, epoch = [], self.position.epoch
            batch.append(window)
            if len(batch) == self.global_batch:
                if self.position.step_done(self.skip_steps):
                    yield rows_arrays(batch[lo:hi], True) if self.packing else np.stack(batch[lo:hi])
                batch = []


@dataclass
class RowStream:
    """Classifiers: one replica's share of each global batch of labelled rows (encoded by
    Ray Data's tasks, build_rows_dataset), in the dataset's order. Rows of an epoch that do
    not fill a last global batch are dropped; a sample of ``position`` is a row."""

    iterator: object
    global_batch: int
    dp: int
    dp_rank: int
    seed: int
    num_classes: int
    epochs: int = 0
    shuffle_buffer: int = 0
    skip_steps: int = 0
    position: StreamPosition = field(default_factory=StreamPosition)

    def _rows(self) -> Iterator[dict]:
        """The rows one by one in the stored order, their labels checked."""
        from raytrain_hybrid.data.rows import check_labels

        for batch in self.iterator.iter_batches(batch_size=256, batch_format="numpy"):
            check_labels(np.asarray(batch["label"]), self.num_classes, "data.path")
            columns = {k: np.asarray(v) for k, v in batch.items()}
            for i in range(len(columns["label"])):
                yield {k: v[i] for k, v in columns.items()}

    def __iter__(self) -> Iterator[dict]:
        share = self.global_batch // self.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        epoch = 0
        while self.epochs == 0 or epoch < self.epochs:
            self.position.epoch, self.position.samples_in_epoch, self.position.documents_in_epoch = epoch, 0, 0
            held: list[dict] = []
            count = 0
            for row in shuffled(self._rows(), self.shuffle_buffer, self.seed + epoch):
                held.append(row)
                count += 1
                if len(held) == self.global_batch:
                    step_rows = {k: np.stack([r[k] for r in held]) for k in held[0]}
                    held = []
                    self.position.samples_in_epoch += self.global_batch
                    self.position.documents_in_epoch = self.position.samples_in_epoch
                    if self.position.step_done(self.skip_steps):
                        yield {k: v[lo:hi] for k, v in step_rows.items()}
            if self.position.samples_in_epoch == 0:
                raise ValueError(
                    f"the dataset holds {count} rows, fewer than one global batch "
                    f"(train.global_batch_size={self.global_batch}): no step can run (data.path)"
                )
            epoch += 1


def stream_args(cfg: Config, dp: int, dp_rank: int) -> dict:
    """What every replica stream takes from the config: the global batch, this replica's share of
    it, the passes and the shuffle."""
    d = cfg.data
    return {
        "global_batch": cfg.train.global_batch_size,
        "dp": dp,
        "dp_rank": dp_rank,
        "seed": d.shuffle_seed,
        "epochs": d.epochs,
        "shuffle_buffer": d.shuffle_buffer,
    }


def replica_stream(cfg: Config, iterator, *, dp: int, dp_rank: int, skip_steps: int = 0):
    """A classifier's rows (RowStream) or a language model's token windows (ReplicaStream)."""
    d = cfg.data
    common = {"iterator": iterator, "skip_steps": skip_steps, **stream_args(cfg, dp, dp_rank)}
    if d.text_columns:
        return RowStream(num_classes=cfg.model.num_classes, **common)
    return ReplicaStream(
        token_column=token_column(cfg),
        seq_len=cfg.model.seq_len,
        vocab_size=cfg.model.vocab_size,
        packing=d.packing,
        **common,
    )


def token_column(cfg: Config) -> str:
    return "input_ids" if cfg.data.text_column else cfg.data.token_column
