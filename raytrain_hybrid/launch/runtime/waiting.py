"""Until a run's first step: a line every few seconds saying what it waits for.

A start can take minutes (workers queued for resources, nodes being added, many workers on
few cores); a terminal that stays silent meanwhile looks hung. The driver asks ``due`` on each
pass of its loop and says the line ``what`` makes: the worker group's placement group still
pending (and the resources free now), the workers starting (Ray's processes, imports, the
process group), or started and building the model and reading the first batch.
"""

from __future__ import annotations

import time

SAY_EVERY_S = 10.0


class Waiting:
    def __init__(self, since: float, every_s: float = SAY_EVERY_S) -> None:
        self.since, self.every_s = since, every_s
        self.next_at = since + every_s

    def due(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if now < self.next_at:
            return False
        self.next_at = now + self.every_s
        return True

    def what(self, starts: int, now: float | None = None) -> str:
        """``starts``: worker groups whose rank 0 has said it started (progress.RunLog.starts)."""
        waited = (time.time() if now is None else now) - self.since
        if starts:
            doing = "the workers are up; building the model, loading weights and reading the first batch"
        else:
            doing = pending_placement() or "the workers are starting (Ray's worker processes, imports, process group)"
        return f"waiting {waited:.0f} s for the first step: {doing}"


def pending_placement() -> str:
    """The worker group's placement group while Ray cannot place it yet, and what is free; "" when none."""
    import ray

    try:
        pending = [pg for pg in ray.util.placement_group_table().values() if pg.get("state") == "PENDING"]
        if not pending:
            return ""
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    except Exception:  # noqa: BLE001 (a state query that fails says nothing rather than stopping the run)
        return ""
    bundles = pending[0]["bundles"]
    each = next(iter(bundles.values()), {})
    return (
        f"Ray has not placed the {len(bundles)} workers yet (each asks {each}; free now {free}): "
        "the resources are busy, or the autoscaler is adding nodes"
    )
