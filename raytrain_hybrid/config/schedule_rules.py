"""What a pipeline schedule takes in micro-batches per replica: one definition for the config
check (config.validate, which names the fix) and for the dp values an elastic run may take
(config.elastic, which asks the same of every dp)."""

from __future__ import annotations

from raytrain_hybrid.config.schema import MULTI_STAGE_SCHEDULES, V_SCHEDULES


def min_microbatches(schedule: str, pp: int) -> int:
    """Every schedule but GPipe needs at least pp micro-batches to fill the pipeline; DualPipeV
    one per stage, 2*pp (torch refuses fewer)."""
    if pp == 1 or schedule == "GPipe":
        return 1
    return 2 * pp if schedule == "DualPipeV" else pp


def too_few_microbatches(schedule: str, pp: int, microbatches: int) -> bool:
    return microbatches < min_microbatches(schedule, pp)


def uneven_microbatches(schedule: str, pp: int, microbatches: int) -> bool:
    """Multi-stage and V schedules run micro-batches in rounds of pp."""
    return schedule in MULTI_STAGE_SCHEDULES + V_SCHEDULES and bool(microbatches % pp)
