"""What a worker is given: the run's plan as its workers need it (``WorkerPlan``, read-only, the
same on every rank) and its wiring to the launcher that started it (``WorkerIO``). Light on
purpose: the driver builds the plan without importing torch or the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raytrain_hybrid.config import Config

if TYPE_CHECKING:
    import torch

    from raytrain_hybrid.storage import Store


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker of a run is given, read-only: the driver's RunPlan (launch.runtime.start) as its
    workers need it, derived once on the driver. A run without a driver (the engine's tests, the
    benchmarks) gives ``WorkerPlan(cfg)``."""

    cfg: Config  # the run's config: at the layout it starts with, run.output_dir absolute or a URI, data.path resolved
    use_gpu: bool = False
    resume: str | None = None  # a verified checkpoint directory to continue from (model, optimizer, data position)
    launch_id: str = ""  # written into every manifest: a restart tells this launch's checkpoints apart
    # The steps the run trains when the driver knows that data.epochs end the data before
    # train.steps (launch.plan.inputs.steps_to_train); None: train.steps.
    end: int | None = None
    # The step at which this run's data began (0; a resume that starts a new data set from its
    # beginning: the step it resumed at), so the stream skips the steps since then; None: the
    # resumed checkpoint's own.
    data_origin: int | None = None
    trajectory: dict | None = None  # what the driver recorded of the run's trajectory, in every manifest
    data_env: dict[str, str] = field(default_factory=dict)  # Ray Data's readers' environment (launch.plan.inputs)
    layout_hardware: dict | None = None  # an elastic run with layout=auto: the profile each start's pick is priced on
    registered_models: tuple = ()  # models.custom's registrations (import paths), made again on each worker


@dataclass
class WorkerIO:
    """A worker's wiring to its launcher (Ray Train, torchrun, a test): where its input comes from
    and whom it tells of its progress. Every field may be left out.

    ``dataset_fn`` returns this rank's Ray Data iterator (called by replica leaders only); without
    it the input is the shipped corpus, windowed in memory (engine tests without Ray), or for
    classifiers the shipped rows. ``val_fn``, likewise, the validation rows' iterator
    (classifiers evaluate every ``train.eval_interval`` steps and after the last).
    ``on_checkpoint(steps_done, directory, metrics)`` runs on every rank, at the same step
    boundary, once a save is complete (a background save: a step or more after it started;
    ``metrics`` are those of the step it saved, with the save's timings).
    ``notice()``: whether this rank has heard that a node of the group is about to go (a
    preemption); read before every step. At the first step any rank heard of one, every rank
    calls ``on_notice(steps_done, None)``, saves a checkpoint at the step's end and waits for
    it (the last chance), calls ``on_notice(steps_done, saved)`` and trains on until the group
    is stopped.
    ``marks`` collects the wall-clock times and process CPU of the start-up phases (:func:`mark`;
    rank 0's are reported). ``predicted_memory``: the planner's bytes for the fullest rank,
    written beside the memory snapshots of run.profile_steps (engine.profile) on CUDA.
    """

    dataset_fn: Callable[[], object] | None = None
    val_fn: Callable[[], object] | None = None
    on_step: Callable[[dict], None] | None = None  # rank 0's step metrics
    on_checkpoint: Callable[[int, Store, dict], None] | None = None
    notice: Callable[[], bool] | None = None
    on_notice: Callable[[int, bool | None], None] | None = None
    marks: dict = field(default_factory=dict)
    device: torch.device | None = None
    predicted_memory: dict | None = None
