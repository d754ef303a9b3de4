"""What rank 0 tells the driver while a run goes on: one frozen dataclass per kind of event, sent
through the driver's Ray queue (launch.runtime.entry), or handed over in the process under torchrun
(launch.runtime.torchrun), and consumed by launch.records.progress.RunLog.

``record()`` is the event as the run's files keep it (summary.json's checkpoints, preemptions and
elastic starts): its fields, without those left unset.
"""

from __future__ import annotations

import dataclasses


def _set_fields(event, keep: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in dataclasses.asdict(event).items() if v is not None or k in keep}


@dataclasses.dataclass(frozen=True)
class StartEvent:
    """A worker group started at ``step`` (every start after the first is a restart), at its layout."""

    step: int
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    microbatches: int | None = None

    @classmethod
    def of(cls, step: int, cfg) -> StartEvent:
        """A start at ``step`` at ``cfg``'s layout (this start's: an elastic run's dp, a pick of layout=auto)."""
        par = cfg.parallelism
        return cls(step, dp=par.dp, tp=par.tp, pp=par.pp, microbatches=par.microbatches)

    def record(self) -> dict:
        return _set_fields(self)


@dataclasses.dataclass(frozen=True)
class LayoutEvent:
    """An elastic run with layout=auto: what this start's pick said (launch.plan.autolayout)."""

    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """One step's metrics (metrics.jsonl's line)."""

    metrics: dict


@dataclasses.dataclass(frozen=True)
class CheckpointEvent:
    """A checkpoint complete on every rank, with its save's timings."""

    step: int
    path: str
    write_s: float  # DCP's write of rank 0's shards, from the save's start
    save_s: float  # to the manifest (or rename)
    blocked_s: float  # the time the steps waited for it

    @classmethod
    def of(cls, step: int, path, metrics: dict) -> CheckpointEvent:
        """From the metrics of the step it saved (engine.worker.StepLoop adds the timings)."""
        return cls(step, str(path), metrics["write_s"], metrics["save_s"], metrics["blocked_s"])

    def record(self) -> dict:
        return _set_fields(self)


@dataclasses.dataclass(frozen=True)
class PreemptionEvent:
    """A preemption notice: when the ranks agreed on it (``saved`` None; ``noticed_at`` and, from
    Ray Train, the nodes, ranks and deadline), then once its save is complete (``saved``, ``saved_at``)."""

    step: int
    saved: bool | None = None
    noticed_at: float | None = None
    saved_at: float | None = None
    nodes: list | None = None
    ranks: list | None = None
    deadline_ms: int | None = None

    def record(self) -> dict:
        return _set_fields(self, keep=("saved",))


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    """The worker loop ended: every rank's report (memory, coordinates, inputs) and rank 0's start-up marks."""

    memory: list
    marks: dict = dataclasses.field(default_factory=dict)


RunEvent = StartEvent | LayoutEvent | StepEvent | CheckpointEvent | PreemptionEvent | DoneEvent
