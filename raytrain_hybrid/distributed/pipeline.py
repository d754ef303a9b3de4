"""Pipeline stages and schedules from torch.distributed.pipelining, chosen by name."""

from __future__ import annotations

from raytrain_hybrid.config import SINGLE_STAGE_SCHEDULES, V_SCHEDULES

_SCHEDULE_CLASSES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous blocks per stage; when uneven, the middle stages take the extra blocks
    because the first and last also carry the embedding and the head."""
    base, extra = divmod(num_layers, num_stages)
    order = sorted(range(num_stages), key=lambda s: abs(s - (num_stages - 1) / 2))
    sizes = [base + (1 if s in order[:extra] else 0) for s in range(num_stages)]
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_ids(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Global stage indices held by one pipeline rank: looped, or V-shaped (ZBV, DualPipeV)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def build_schedule(schedule: str, stages: list, microbatches: int, loss_fn):
    # Imported here: the planner reads the stage split above without torch (`plan`, `check`).
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, _SCHEDULE_CLASSES[schedule])
    # scale_grads divides accumulated gradients by the micro-batch count, so a loss_fn
    # returning each micro-batch's mean gives the gradient of the batch mean.
    if schedule in SINGLE_STAGE_SCHEDULES:
        assert len(stages) == 1
        return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
