"""Training input through Ray Data, sharded along the DP axis only.

Why not Ray Train's default split: it gives every *worker* its own shard, but
all tp*pp ranks of a data-parallel replica must see the same rows. And a
streaming split hands blocks to whichever consumer asks first, so the rows a
replica gets would depend on timing and on dp, and the single-process oracle
would no longer hold.

What we do instead: the dataset is read in a fixed order (``preserve_order``), then
shuffled here through a buffer seeded per epoch (``shuffled``). One leader per replica (its
rank at pp=0, tp=0) iterates that stream, makes its items into rows (data.sources:
windows of ``seq_len + 1`` tokens, where short documents are packed, never dropped; or
examples; or labelled rows), cuts the rows into global batches of ``global_batch_size``
and keeps its contiguous share; it broadcasts the share to the other ranks of its replica. So the global
batch of step k is the same for every layout, each row is used once per epoch
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
from raytrain_hybrid.data.sources import Examples, LabelledRows, Source, TokenDocuments


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

    A sample is what one row of a global batch holds (data.sources): a window of seq_len+1
    tokens or a packed row for a language model, an example, a labelled row for a classifier;
    a document is an item the source read (a document, an example, a row).
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
    """One replica's share of each global batch, from a source of examples (data.sources:
    token documents, chat examples, labelled rows); the loop over epochs and global batches,
    the same for every source, is here.

    Each epoch reads the source's items in the stored order through the shuffle buffer seeded
    with ``seed + epoch``; the source makes them into rows; the global batch of step k is the
    k-th run of ``global_batch`` rows and replica ``dp_rank`` keeps its contiguous share. The
    first ``skip_steps`` global batches (a resumed run's) are read and not yielded.
    """

    source: Source
    global_batch: int
    dp: int
    dp_rank: int
    seed: int
    epochs: int = 0  # 0: as many as the run needs
    shuffle_buffer: int = 0
    skip_steps: int = 0  # global batches already trained on (a resumed run)
    position: StreamPosition = field(default_factory=StreamPosition)

    def _items(self, epoch: int) -> Iterator:
        """The epoch's items in its order, counted as the source takes them."""
        for item in shuffled(self.source.items(), self.shuffle_buffer, self.seed + epoch):
            self.position.documents_in_epoch += 1
            yield item

    def __iter__(self) -> Iterator[np.ndarray | dict]:
        """Yields the replica's share of each global batch, one per step (source.arrays)."""
        share = self.global_batch // self.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        held: list = []
        epoch = made = 0
        while self.epochs == 0 or epoch < self.epochs:
            self.position.epoch, self.position.samples_in_epoch, self.position.documents_in_epoch = epoch, 0, 0
            if self.source.whole_epochs:
                held = []  # the last epoch's rows that filled no global batch are dropped
            steps = 0
            for row in self.source.rows(self._items(epoch)):
                self.position.samples_in_epoch += 1
                made += 1
                held.append(row)
                if len(held) < self.global_batch:
                    continue
                steps += 1
                if self.position.step_done(self.skip_steps):
                    yield self.source.arrays(held[lo:hi])
                held = []
            if self.source.whole_epochs and not steps:
                raise ValueError(
                    f"the dataset holds {len(held)} {self.source.unit}, fewer than one global batch "
                    f"(train.global_batch_size={self.global_batch}): no step can run (data.path)"
                )
            epoch += 1
        if made < self.global_batch:  # data.epochs passes made no global batch: the run would train no step
            raise ValueError(
                f"the dataset makes {made} rows in data.epochs={self.epochs} passes, fewer than one global batch "
                f"(train.global_batch_size={self.global_batch}): no step can run (data.path); raise data.epochs "
                "(0: no limit) or give more data"
            )


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


def replica_stream(cfg: Config, iterator, *, dp: int, dp_rank: int, skip_steps: int = 0) -> ReplicaStream:
    """The stream of the run's input (``iterator``: a Ray DataIterator, or data.local_rows' for
    a run without Ray) from the source the config names: a classifier's labelled rows, chat or
    prompt/completion examples (data.format), or a language model's documents."""
    d, m = cfg.data, cfg.model
    source: Source
    if d.text_columns:
        source = LabelledRows(iterator, num_classes=m.num_classes)
    elif d.format != "text":
        source = Examples(iterator, seq_len=m.seq_len, vocab_size=m.vocab_size, packing=d.packing)
    else:
        source = TokenDocuments(iterator, token_column(cfg), m.seq_len, m.vocab_size, packing=d.packing)
    return ReplicaStream(source, skip_steps=skip_steps, **stream_args(cfg, dp, dp_rank))


def token_column(cfg: Config) -> str:
    return "input_ids" if cfg.data.text_column else cfg.data.token_column
