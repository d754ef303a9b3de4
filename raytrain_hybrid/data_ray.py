"""Training input through Ray Data, sharded along the DP axis only.

Why not Ray Train's default split: it gives every *worker* its own shard, but
all tp*pp ranks of a data-parallel replica must see the same rows. And a
streaming split hands blocks to whichever consumer asks first, so the rows a
replica gets would depend on timing and on dp, and the single-process oracle
would no longer hold.

What we do instead: the dataset is read in a fixed order (``preserve_order``,
a local shuffle of documents seeded per epoch; blocks keep their stored order). One leader per replica (its
rank at pp=0, tp=0) iterates that stream, packs documents into windows of
``seq_len + 1`` tokens (short documents are packed, never dropped), cuts the
windows into global batches of ``global_batch_size`` and keeps its contiguous
share; it broadcasts the share to the other ranks of its replica. So the global
batch of step k is the same for every layout, each window is used once per epoch
across replicas, and only one rank per replica reads. The price: every replica
leader streams the whole dataset and drops the (dp-1)/dp it does not keep.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from raytrain_hybrid.config import Config


@dataclass
class StreamPosition:
    """Where the stream is: enough to skip to the same place after a restart."""

    epoch: int = 0
    windows_in_epoch: int = 0
    documents_in_epoch: int = 0
    steps: int = 0


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

    def _documents(self, epoch: int) -> Iterator[tuple[np.ndarray, str]]:
        kwargs = {}
        if self.shuffle_buffer:
            kwargs = {"local_shuffle_buffer_size": self.shuffle_buffer, "local_shuffle_seed": self.seed + epoch}
        for batch in self.iterator.iter_batches(batch_size=64, batch_format="pyarrow", **kwargs):
            column = batch.column(self.token_column)
            paths = batch.column("path").to_pylist() if "path" in batch.column_names else [""] * len(batch)
            for i, ids in enumerate(column.to_pylist()):
                yield np.asarray(ids, dtype=np.int64), paths[i]

    def _windows(self) -> Iterator[np.ndarray]:
        width = self.seq_len + 1
        epoch = 0
        while self.epochs == 0 or epoch < self.epochs:
            buffer: list[np.ndarray] = []
            held = 0
            self.position.epoch, self.position.windows_in_epoch, self.position.documents_in_epoch = epoch, 0, 0
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
                buffer.append(ids)
                held += ids.size
                if held >= width:
                    flat = np.concatenate(buffer)
                    n = flat.size // width
                    for w in flat[: n * width].reshape(n, width):
                        self.position.windows_in_epoch += 1
                        yield w
                    rest = flat[n * width :]
                    buffer, held = [rest], rest.size
            if not any_rows:
                raise ValueError("the dataset is empty: no rows to train on (data.path)")
            epoch += 1  # the tail shorter than one window is carried into no window

    def __iter__(self) -> Iterator[np.ndarray]:
        """Yields [global_batch/dp, seq_len+1] int64 arrays, one per step."""
        share = self.global_batch // self.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        batch: list[np.ndarray] = []
        for window in self._windows():
            batch.append(window)
            if len(batch) == self.global_batch:
                self.position.steps += 1
                if self.position.steps > self.skip_steps:
                    yield np.stack(batch[lo:hi])
                batch = []


@dataclass
class RowStream:
    """Classifiers: one replica's share of each global batch of labelled rows (encoded by
    Ray Data's tasks, build_rows_dataset), in the dataset's order. Rows of an epoch that do
    not fill a last global batch are dropped; ``position.windows_in_epoch`` counts rows."""

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

    def __iter__(self) -> Iterator[dict]:
        from raytrain_hybrid.rows import check_labels

        share = self.global_batch // self.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        epoch = 0
        while self.epochs == 0 or epoch < self.epochs:
            self.position.epoch, self.position.windows_in_epoch, self.position.documents_in_epoch = epoch, 0, 0
            kwargs = {}
            if self.shuffle_buffer:
                kwargs = {"local_shuffle_buffer_size": self.shuffle_buffer, "local_shuffle_seed": self.seed + epoch}
            held: dict[str, list] = {}
            count = 0
            for batch in self.iterator.iter_batches(
                batch_size=self.global_batch, batch_format="numpy", drop_last=False, **kwargs
            ):
                check_labels(np.asarray(batch["label"]), self.num_classes, "data.path")
                for k, v in batch.items():
                    held.setdefault(k, []).append(np.asarray(v))
                count += len(batch["label"])
                while count >= self.global_batch:
                    rows = {k: np.concatenate(v) for k, v in held.items()}
                    step_rows = {k: v[: self.global_batch] for k, v in rows.items()}
                    held = {k: [v[self.global_batch :]] for k, v in rows.items()}
                    count -= self.global_batch
                    self.position.windows_in_epoch += self.global_batch
                    self.position.documents_in_epoch = self.position.windows_in_epoch
                    self.position.steps += 1
                    if self.position.steps > self.skip_steps:
                        yield {k: v[lo:hi] for k, v in step_rows.items()}
            if self.position.windows_in_epoch == 0:
                raise ValueError(
                    f"the dataset holds {count} rows, fewer than one global batch "
                    f"(train.global_batch_size={self.global_batch}): no step can run (data.path)"
                )
            epoch += 1


def build_rows_dataset(cfg: Config, path: str):
    """Classifiers: the labelled rows of ``path``, tokenized and encoded in Ray Data's tasks."""
    import ray.data

    from raytrain_hybrid.rows import encode, encoder_kwargs

    d = cfg.data
    kwargs = encoder_kwargs(cfg)
    ds = ray.data.read_parquet(path).select_columns([*d.text_columns, *d.tabular_columns, d.label_column])
    return ds.map_batches(lambda b: encode(b, **kwargs), batch_format="numpy", batch_size=256)


def build_dataset(cfg: Config):
    """The Ray Dataset the trainer streams: documents with token ids (tokenized here if text)."""
    import ray.data

    from raytrain_hybrid.data_prep import tokenize_batch

    d = cfg.data
    if d.text_columns:  # a classifier's rows (validate() fills text_columns for those only)
        return build_rows_dataset(cfg, d.path)
    ds = ray.data.read_parquet(d.path, include_paths=True).select_columns([d.text_column or d.token_column, "path"])
    if d.text_column:
        tokenizer = resolve_tokenizer(cfg)
        ds = ds.map_batches(
            lambda b: tokenize_batch(b, text_column=d.text_column, tokenizer=tokenizer).append_column(
                "path", b.column("path")
            ),
            batch_format="pyarrow",
            batch_size=256,
        )
    return ds


def replica_stream(cfg: Config, iterator, *, dp: int, dp_rank: int, skip_steps: int = 0):
    """A classifier's rows (RowStream) or a language model's token windows (ReplicaStream)."""
    d = cfg.data
    common = {
        "iterator": iterator,
        "global_batch": cfg.train.global_batch_size,
        "dp": dp,
        "dp_rank": dp_rank,
        "seed": d.shuffle_seed,
        "epochs": d.epochs,
        "shuffle_buffer": d.shuffle_buffer,
        "skip_steps": skip_steps,
    }
    if d.text_columns:
        return RowStream(num_classes=cfg.model.num_classes, **common)
    return ReplicaStream(
        token_column=token_column(cfg), seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size, **common
    )


def _data_config_base():
    import ray.train

    return ray.train.DataConfig


class ReplicaDataConfig(_data_config_base()):
    """Every rank gets an iterator over the whole ordered dataset; only replica leaders use it
    (see the module docstring). Nothing is split here: the split is by position in the stream."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        out = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            for rank in range(world_size):
                out[rank][name] = ordered_iterator(ds)
        return out


def ordered_iterator(ds):
    """An iterator over ``ds`` in its defined order: the order is what defines the batches."""
    ds = ds.copy(ds)
    ds.context.execution_options.preserve_order = True
    return ds.iterator()


def builtin_dataset(cfg: Config) -> str:
    """The shipped corpus as token Parquet, prepared once per corpus+tokenizer into a cache."""
    import hashlib
    import os
    from pathlib import Path

    from raytrain_hybrid.data import DEFAULT_CORPUS
    from raytrain_hybrid.data_prep import prepare_data

    tokenizer = resolve_tokenizer(cfg)
    digest = hashlib.sha256(DEFAULT_CORPUS.read_bytes() + Path(tokenizer).read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("RAYTRAIN_HYBRID_CACHE", "~/.cache/raytrain_hybrid")).expanduser()
    out = cache / f"builtin-{digest}"
    if not (out / "_DONE").exists():
        tmp = cache / f"builtin-{digest}.tmp{os.getpid()}"
        prepare_data(str(DEFAULT_CORPUS), str(tmp), tokenizer=tokenizer)
        (tmp / "_DONE").write_text("ok\n")
        tmp.rename(out) if not out.exists() else None
    return str(out)


def resolve_tokenizer(cfg: Config) -> str:
    from pathlib import Path

    from raytrain_hybrid.data import DEFAULT_TOKENIZER

    return str(Path(cfg.data.tokenizer or DEFAULT_TOKENIZER).resolve())


def token_column(cfg: Config) -> str:
    return "input_ids" if cfg.data.text_column else cfg.data.token_column


def schema_check(cfg: Config) -> int:
    """Before any worker starts: the files open, the column exists with the right type, rows exist.

    Returns the number of rows. Reads only Parquet footers.
    """
    import pyarrow.dataset as pads

    from raytrain_hybrid.errors import ConfigError

    d = cfg.data
    if d.text_columns:
        rows = _rows_schema_check(cfg, "data.path", d.path)
        if d.val_path:
            _rows_schema_check(cfg, "data.val_path", d.val_path)
        return rows
    try:
        dataset = pads.dataset(d.path, format="parquet")
        files = dataset.files
    except (OSError, pa.ArrowInvalid, FileNotFoundError) as exc:
        raise ConfigError("data.path", d.path, f"cannot be read as Parquet: {exc}") from exc
    if not files:
        raise ConfigError("data.path", d.path, "holds no Parquet files")
    rows = 0
    for f in files:
        try:
            meta = pads.dataset(f, format="parquet")
            schema = meta.schema
            rows += meta.count_rows()
        except (OSError, pa.ArrowInvalid) as exc:
            raise ConfigError("data.path", f, f"is not a readable Parquet file: {exc}") from exc
        key, column = ("data.text_column", d.text_column) if d.text_column else ("data.token_column", d.token_column)
        if column not in schema.names:
            raise ConfigError(key, column, f"is not a column of {f}; its columns are {schema.names}")
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
        _check_tokenizer(cfg)
    return rows


def _check_tokenizer(cfg: Config) -> None:
    """Text is tokenized in Ray Data's tasks: a missing tokenizer, or one whose ids do not fit
    the model's embedding, must stop the run here rather than in a worker."""
    from raytrain_hybrid.data import load_tokenizer
    from raytrain_hybrid.errors import ConfigError

    try:
        size = load_tokenizer(cfg.data.tokenizer).get_vocab_size()
    except FileNotFoundError as exc:
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, "does not exist; give a local tokenizer.json") from exc
    except Exception as exc:  # tokenizers raises its own error types for a malformed file
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, f"is not a tokenizer.json: {exc}") from exc
    if size > cfg.model.vocab_size:
        raise ConfigError(
            "data.tokenizer",
            cfg.data.tokenizer or "(the shipped BPE)",
            f"has {size} tokens, more than model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {size}",
        )


def _rows_schema_check(cfg: Config, key: str, path: str) -> int:
    """A classifier's Parquet: the text, numeric and label columns exist with usable types."""
    import pyarrow.dataset as pads

    from raytrain_hybrid.errors import ConfigError
    from raytrain_hybrid.models.pretrained import read_config

    d = cfg.data
    try:
        dataset = pads.dataset(path, format="parquet")
        schema, files = dataset.schema, dataset.files
    except (OSError, pa.ArrowInvalid, FileNotFoundError) as exc:
        raise ConfigError(key, path, f"cannot be read as Parquet: {exc}") from exc
    if not files:
        raise ConfigError(key, path, "holds no Parquet files")
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
                raise ConfigError(field_key, column, f"is not a column of {path}; its columns are {schema.names}")
            if not ok(schema.field(column).type):
                raise ConfigError(field_key, column, f"has type {schema.field(column).type} in {path}, not {what}")
    rows = dataset.count_rows()
    if key == "data.path" and rows < cfg.train.global_batch_size:
        raise ConfigError(
            key, path, f"has {rows} rows, fewer than train.global_batch_size={cfg.train.global_batch_size}"
        )
    if rows == 0:
        raise ConfigError(key, path, "has no rows")
    from raytrain_hybrid.rows import tokenizer_path

    tok = tokenizer_path(cfg)
    try:
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(tok).get_vocab_size()
    except Exception as exc:
        raise ConfigError(
            "data.tokenizer", cfg.data.tokenizer or tok, f"is not a usable tokenizer.json: {exc}"
        ) from exc
    if size > cfg.model.vocab_size:
        raise ConfigError(
            "data.tokenizer",
            cfg.data.tokenizer or tok,
            f"has {size} tokens, more than model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {size}"
            + (" (or use the checkpoint's own tokenizer)" if read_config(cfg.model.pretrained) else ""),
        )
    return rows
