"""Validation of classifiers: accuracy, F1, ROC AUC and loss over the validation rows.

Every replica evaluates its share of the rows through the same layout it trains with
(pipeline schedules forward-only, TP, FSDP). The rows go in rounds of dp * (replica batch)
so that every replica runs the same number of forward passes, which FSDP's collectives
and the fixed pipeline shapes need; the last round is padded and the padding dropped.
The logits of each replica's last stage are gathered and every rank computes the same
metrics.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from raytrain_hybrid.data.rows import (
    BUILTIN_VAL,
    check_labels,
    feed_schema,
    read_parquet_rows,
    schema_buffers,
    to_batch,
)
from raytrain_hybrid.distributed.utils import mesh_device
from raytrain_hybrid.engine.loss import ClassLoss


class ValidationSet:
    def __init__(self, cfg, mesh, arrays: dict | None, rows: int, *, broadcast: bool, device) -> None:
        self.cfg, self.mesh, self.arrays, self.rows = cfg, mesh, arrays, rows
        self.broadcast, self.device = broadcast, device
        self.dp = cfg.parallelism.dp
        self.share = cfg.train.global_batch_size // self.dp

    @classmethod
    def open(cls, cfg, mesh, *, val_fn, in_memory: bool) -> ValidationSet | None:
        device = mesh_device(mesh.world)
        if in_memory:  # every rank reads the (small) file itself
            arrays = read_parquet_rows(cfg.data.val_path or BUILTIN_VAL, cfg)
            return cls(cfg, mesh, arrays, len(arrays["label"]), broadcast=False, device=device)
        if val_fn is None:
            return None
        leader = mesh.replica.get_local_rank() == 0
        arrays = read_iterator(val_fn(), cfg) if leader else None
        count = torch.tensor([len(arrays["label"]) if leader else 0], device=device)
        dist.broadcast(count, group=mesh.replica.get_group(), group_src=0)
        return cls(cfg, mesh, arrays, int(count.item()), broadcast=True, device=device)

    def chunks(self, dp_rank: int):
        """(Batch, valid rows) per round for replica ``dp_rank``; same count on every replica."""
        per_round = self.dp * self.share
        for r in range(math.ceil(self.rows / per_round)):
            start = r * per_round + dp_rank * self.share
            valid = max(0, min(self.share, self.rows - start))
            arrays = None
            if self.arrays is not None:
                idx = np.arange(start, start + self.share)
                idx[valid:] = 0  # padding: any real row, dropped afterwards
                arrays = {k: v[idx] for k, v in self.arrays.items()}
            if self.broadcast:  # the replica's leader holds the rows
                bufs = schema_buffers(feed_schema(self.cfg, self.share), self.device, arrays)
                for buf in bufs.values():
                    dist.broadcast(buf, group=self.mesh.replica.get_group(), group_src=0)
                arrays = {k: v.cpu() for k, v in bufs.items()}
            yield to_batch(arrays), valid


def read_iterator(iterator, cfg) -> dict:
    """All rows of a Ray Data iterator over encoded rows, in order."""
    parts: dict[str, list] = {}
    for batch in iterator.iter_batches(batch_size=256, batch_format="numpy"):
        for k in ("ids_a", "mask_a", "ids_b", "mask_b", "tabular", "label"):
            parts.setdefault(k, []).append(np.asarray(batch[k]))
    if not parts:
        raise ValueError("the validation data (data.val_path) has no rows")
    arrays = {k: np.concatenate(v) for k, v in parts.items()}
    check_labels(arrays["label"], cfg.model.num_classes, "data.val_path")
    return arrays


def classification_metrics(logits: np.ndarray, labels: np.ndarray, weights: list[float]) -> dict:
    from sklearn.metrics import f1_score, roc_auc_score

    classes = logits.shape[1]
    probs = torch.softmax(torch.from_numpy(logits), dim=-1).numpy()
    pred = probs.argmax(1)
    loss = ClassLoss(weights, classes, torch.device("cpu"))(torch.from_numpy(logits), torch.from_numpy(labels))
    out = {
        "val_loss": float(loss),
        "val_accuracy": float((pred == labels).mean()),
        "val_f1": float(f1_score(labels, pred, average="binary" if classes == 2 else "macro", zero_division=0)),
        "val_auc": None,
        "val_majority": float(np.bincount(labels, minlength=classes).max() / len(labels)),
        "val_rows": int(len(labels)),
    }
    if len(np.unique(labels)) == classes:  # AUC needs every class present
        auc = roc_auc_score(labels, probs[:, 1]) if classes == 2 else roc_auc_score(labels, probs, multi_class="ovr")
        out["val_auc"] = float(auc)
    return out


def evaluate(trainer, validation: ValidationSet) -> dict:
    """Validation metrics (the same dict on every rank)."""
    keep = trainer.mesh.tp.get_local_rank() == 0
    logits, labels = [], []
    for batch, valid in validation.chunks(trainer.dp_rank):
        out = trainer.predict(batch)
        if out is not None and keep and valid:
            logits.append(out[:valid].cpu().numpy())
            labels.append(batch.labels[:valid].numpy())
    mine = (np.concatenate(logits), np.concatenate(labels)) if logits else None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    parts = [g for g in gathered if g is not None]
    all_logits = np.concatenate([p[0] for p in parts])
    all_labels = np.concatenate([p[1] for p in parts])
    assert len(all_labels) == validation.rows, (len(all_labels), validation.rows)
    return classification_metrics(all_logits, all_labels, trainer.cfg.model.class_weights)
