"""Labelled rows for classifiers: two text columns, numeric columns and a label.

A row becomes fixed-size arrays: each text is tokenized (the checkpoint's tokenizer.json)
and padded or truncated to ``model.seq_len`` with a 0/1 mask; the numeric columns become
one float32 vector; the label an int64. The global batch of step k is the k-th slice of a
per-epoch order, the same for every layout, and replica r takes the r-th contiguous share
(as for token windows, data.corpus). An epoch's last rows that do not fill a global batch wait
for the next epoch's order, i.e. are dropped from this epoch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from raytrain_hybrid.data.corpus import IGNORE_INDEX, Batch
from raytrain_hybrid.data.tokenizer import ASSETS, classifier_tokenizer, load_tokenizer

BUILTIN_TRAIN = ASSETS / "shipments_train.parquet"
BUILTIN_VAL = ASSETS / "shipments_val.parquet"
# First-stage inputs of a classifier, in the order its stage forward takes them.
INPUTS = ("ids_a", "mask_a", "ids_b", "mask_b", "tabular")


def encode(columns: dict, *, text_columns, tabular_columns, label_column, tokenizer: str, seq_len: int) -> dict:
    """Column arrays (text as strings) -> the model's arrays, batch-major."""
    tok = load_tokenizer(tokenizer, fixed_length=seq_len)
    out = {}
    for suffix, name in zip(("a", "b"), text_columns, strict=True):
        encs = tok.encode_batch([str(t) if t is not None else "" for t in columns[name]])
        out[f"ids_{suffix}"] = np.asarray([e.ids for e in encs], dtype=np.int64).reshape(-1, seq_len)
        out[f"mask_{suffix}"] = np.asarray([e.attention_mask for e in encs], dtype=np.int64).reshape(-1, seq_len)
    out["tabular"] = np.stack([_numbers(columns[c], c, "data.tabular_columns") for c in tabular_columns], axis=1)
    out["label"] = _numbers(columns[label_column], label_column, "data.label_column").astype(np.int64)
    return out


def _numbers(values, column: str, key: str) -> np.ndarray:
    """A numeric column as float32; a missing or non-numeric value stops the run, named."""
    try:
        out = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        out = None
    if out is None or np.isnan(out).any():
        raise ValueError(
            f"column {column!r} ({key}) holds missing or non-numeric values; fill or drop those rows first"
        )
    return out


def encoder_kwargs(cfg) -> dict:
    d = cfg.data
    return {
        "text_columns": tuple(d.text_columns),
        "tabular_columns": tuple(d.tabular_columns),
        "label_column": d.label_column,
        "tokenizer": classifier_tokenizer(cfg),
        "seq_len": cfg.model.seq_len,
    }


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.size:
        raise ValueError(
            f"label {int(bad[0])} in {where} is outside [0, model.num_classes={num_classes}); "
            "set model.num_classes or fix the labels"
        )


def feed_schema(cfg, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What a replica's leader broadcasts per step: name -> (shape, dtype)."""
    from raytrain_hybrid.models import get_arch

    s = cfg.model.seq_len
    if get_arch(cfg.model.arch).task == "lm":
        window = ((rows, s + 1), torch.int64)
        if cfg.data.packing:  # examples packed in rows (data.packing): their masks and positions
            return {"tokens": window, "label_mask": window, "positions": window}
        if cfg.data.format != "text":  # one example a row: which tokens the loss counts
            return {"tokens": window, "label_mask": window}
        return {"tokens": window}
    schema = {k: ((rows, s), torch.int64) for k in ("ids_a", "mask_a", "ids_b", "mask_b")}
    schema["tabular"] = ((rows, len(cfg.data.tabular_columns)), torch.float32)
    schema["label"] = ((rows,), torch.int64)
    return schema


def schema_buffers(schema: dict, device, arrays: dict | None = None) -> dict[str, torch.Tensor]:
    """Tensors for a broadcast of ``schema`` on ``device``, filled from ``arrays`` (the sender's)."""
    bufs = {k: torch.zeros(shape, dtype=dtype, device=device) for k, (shape, dtype) in schema.items()}
    for k, buf in bufs.items() if arrays is not None else ():
        buf.copy_(torch.as_tensor(arrays[k]))
    return bufs


def to_batch(arrays: dict) -> Batch:
    """Broadcast tensors (or arrays) -> a Batch: LM windows shift by one token; a label the
    loss does not count (``label_mask`` 0) is IGNORE_INDEX. Packed rows (data.packing) add
    their position ids as the model's second input, [rows, seq_len] like the token ids."""
    t = {k: torch.as_tensor(v) for k, v in arrays.items()}
    if "tokens" in t:
        w = t["tokens"]
        labels = w[:, 1:]
        if "label_mask" in t:
            labels = torch.where(t["label_mask"][:, 1:] > 0, labels, IGNORE_INDEX)
        inputs = (w[:, :-1].contiguous(),)
        if "positions" in t:
            inputs = (*inputs, t["positions"][:, :-1].contiguous())
        return Batch(inputs=inputs, labels=labels.contiguous())
    return Batch(inputs=tuple(t[k] for k in INPUTS), labels=t["label"])


def read_parquet_rows(path: str | Path, cfg) -> dict:
    """A whole (small) Parquet file or directory, encoded, in this process."""
    import pyarrow.parquet as pq

    d = cfg.data
    table = pq.read_table(str(path), columns=[*d.text_columns, *d.tabular_columns, d.label_column])
    arrays = encode({c: table.column(c).to_pylist() for c in table.column_names}, **encoder_kwargs(cfg))
    check_labels(arrays["label"], cfg.model.num_classes, str(path))
    return arrays


def steps_in_passes(rows: int, epochs: int, global_batch: int) -> int:
    """Global batches in ``epochs`` passes over ``rows`` rows: each pass drops the rows that do not
    fill a last one (RowBatches here, data.sources.LabelledRows on Ray Data)."""
    return epochs * (rows // global_batch)


class RowBatches:
    """Deterministic global batches over rows held in memory (engine runs without Ray)."""

    def __init__(self, arrays: dict, seed: int) -> None:
        self.arrays = arrays
        self.rows = len(arrays["label"])
        self.seed = seed

    def global_rows(self, step: int, global_batch: int) -> np.ndarray:
        per_epoch = self.rows // global_batch
        if per_epoch < 1:
            raise ValueError(f"{self.rows} rows are fewer than train.global_batch_size={global_batch}")
        epoch, k = divmod(step, per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
        return order[k * global_batch : (k + 1) * global_batch]

    def steps_in(self, epochs: int, global_batch: int) -> int:
        return steps_in_passes(self.rows, epochs, global_batch)

    def take(self, rows: np.ndarray) -> dict:
        return {k: v[rows] for k, v in self.arrays.items()}

    def replica_batch(self, step: int, global_batch: int, dp: int, dp_rank: int) -> Batch:
        rows = self.global_rows(step, global_batch)
        share = global_batch // dp
        return to_batch(self.take(rows[dp_rank * share : (dp_rank + 1) * share]))
