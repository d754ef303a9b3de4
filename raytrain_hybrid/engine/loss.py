"""The step's losses and learning-rate schedule, the same for every layout."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.corpus import IGNORE_INDEX


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine decay to ``min_ratio`` of it at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TokenLoss:
    """Next-token cross-entropy of one micro-batch (labels already shifted): the sum over its
    counted labels (IGNORE_INDEX ones are not) times ``scale``, which ``start_step`` sets to
    microbatches * dp / (counted labels of the whole global batch).

    Why not each micro-batch's mean: with label masks (chat, prompt/completion data) micro-batches
    and replicas count different numbers of tokens, and the mean of their means weighs a token
    of a short answer more than one of a long answer, differently for every split into
    micro-batches and replicas. The pipeline schedule divides the gradients by the micro-batch
    count (scale_grads) and DDP/FSDP/ZeRO-1 average them over dp; with this scale what remains
    is sum(cross-entropy of every counted token of the step) / their count, whatever the layout.
    Without masks every micro-batch counts rows*seq_len labels and this is its mean, as before.
    """

    def __init__(self) -> None:
        self.scale = 1.0

    def start_step(self, counted: int, microbatches: int, dp: int) -> None:
        self.scale = microbatches * dp / max(counted, 1)  # a step with nothing counted moves nothing

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.flatten(0, 1).float()
        return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum") * self.scale


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
        return TokenLoss()
    return ClassLoss(cfg.model.class_weights, cfg.model.num_classes, device)
