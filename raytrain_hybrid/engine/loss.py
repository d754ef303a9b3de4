"""The step's losses and learning-rate schedule, the same for every layout."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from raytrain_hybrid.config import Config


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine decay to ``min_ratio`` of it at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (labels already shifted)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class ClassLoss:
    """sum(weight[label] * cross-entropy) / rows of one micro-batch.

    Not F.cross_entropy(weight=...): that divides by the micro-batch's sum of weights,
    which depends on how the batch is cut into micro-batches and replicas, so layouts
    would train different models. Dividing by the row count keeps the mean over
    micro-batches and replicas equal to the global batch's.
    """

    def __init__(self, weights: list[float], classes: int, device: torch.device) -> None:
        self.weights = torch.tensor(weights or [1.0] * classes, dtype=torch.float32, device=device)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_row = F.cross_entropy(logits.float(), labels, reduction="none")
        return (self.weights[labels] * per_row).mean()


def make_loss(cfg: Config, task: str, device: torch.device):
    if task == "lm":
        return lm_loss
    return ClassLoss(cfg.model.class_weights, cfg.model.num_classes, device)
