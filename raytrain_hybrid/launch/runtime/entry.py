"""What every Ray Train worker runs: the engine's worker loop, wired to Ray Train."""

from __future__ import annotations

import dataclasses
import os
import posixpath
import time
from typing import Any

from raytrain_hybrid.checkpoint.manifest import MANIFEST, read_manifest, step_dirs, verify
from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import at_world
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.records.events import (
    CheckpointEvent,
    DoneEvent,
    LayoutEvent,
    PreemptionEvent,
    StartEvent,
    StepEvent,
)
from raytrain_hybrid.launch.records.tracking import StepLogger
from raytrain_hybrid.storage import open_store


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker (the process group is already initialised). ``loop_config``:
    ``plan``, the run's WorkerPlan (engine.plan), read-only; ``sink``, the driver's event queue;
    ``tracking``, rank 0's tracker run (launch.records.tracking.TrackerRun) or None."""
    entered, entered_cpu = time.time(), time.process_time()  # CPU so far: Ray's (process, imports, group)
    import ray
    import ray.train
    import torch

    from raytrain_hybrid.models.custom import restore

    plan = loop_config["plan"]
    restore(plan.registered_models)  # before the config's model_type is looked up
    cfg = plan.cfg
    os.environ.update(plan.data_env)  # before this worker's Ray Data executor starts
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    from raytrain_hybrid.engine.plan import WorkerIO
    from raytrain_hybrid.engine.worker import mark, run_worker
    from raytrain_hybrid.models import get_arch

    get_arch(cfg.model.arch).import_model_code()  # its transformers classes: counted with the imports
    marks = {"worker_entered": entered, "cpu_worker_entered": entered_cpu}
    mark(marks, "worker_imported")

    sink = loop_config.get("sink")
    node_id = ray.get_runtime_context().get_node_id()  # node IP is shared by virtual nodes
    os.environ.setdefault("LOCAL_RANK", str(ray.train.get_context().get_local_rank()))

    rank = ray.train.get_context().get_world_rank()
    tracker = StepLogger.attach(loop_config.get("tracking"), rank)  # run.tracking: rank 0 logs

    def on_step(metrics: dict) -> None:
        if sink is not None:
            sink.put(StepEvent(metrics))
        tracker.step(metrics)

    def on_checkpoint(steps_done: int, path, metrics: dict) -> None:
        # Written where it stays (under Ray Train's run directory, on any storage): rank 0
        # registers it on Ray Train's own filesystem, so that a restarted worker group gets it
        # from ray.train.get_checkpoint() and `keep` prunes there.
        if rank == 0 and sink is not None:  # before report's barrier: the driver copies its files out sooner
            sink.put(CheckpointEvent.of(steps_done, path, metrics))
        _register(path.uri if rank == 0 else None, {"loss": metrics["loss"], "step": steps_done})
        tracker.checkpoint(steps_done, str(path), metrics)  # registered with Ray now

    def on_notice(steps_done: int, saved: bool | None) -> None:  # every rank: heard (None), then saved
        if rank == 0 and sink is not None:
            sink.put(notice_event(steps_done, saved))

    resume, unheard = _restart_point(plan)
    start = read_manifest(resume)["step"] if resume else 0
    if unheard:  # every rank alike: Ray Train learns of it (retention; the restart after this one)
        _register(resume if rank == 0 else None, {"step": start})
    cfg, said = _start_layout(cfg, node_id, plan.layout_hardware)
    if rank == 0 and sink is not None:  # every start of a worker group: the driver counts restarts
        if said:
            sink.put(LayoutEvent(tuple(said)))
        sink.put(StartEvent.of(start, cfg))
    feeds = cfg.data.path != "memory"
    io = WorkerIO(
        on_step=on_step,
        dataset_fn=(lambda: ray.train.get_dataset_shard("train")) if feeds else None,
        val_fn=(lambda: ray.train.get_dataset_shard("val")) if feeds and cfg.data.val_path else None,
        on_checkpoint=on_checkpoint,
        marks=marks,
        notice=preemption_notice(),
        on_notice=on_notice,
        predicted_memory=predicted_memory(cfg) if plan.use_gpu else None,
    )
    with tracker:  # rank 0's tracking ends with the loop, also when it raises
        # This start's layout and checkpoint: a restart's, or an elastic run's at the workers Ray started.
        result = run_worker(dataclasses.replace(plan, cfg=cfg, resume=resume), node_id, io)
    if rank == 0 and sink is not None:
        sink.put(DoneEvent(result["memory"], result["marks"]))
    # A group restarted from the last step's checkpoint (a node lost, or a preemption's deadline,
    # after it was saved) has no step left to run.
    last = result["history"][-1] if result["history"] else {"loss": None, "step": start - 1}
    ray.train.report({"loss": last["loss"], "step": last["step"]})


def predicted_memory(cfg: Config) -> dict | None:
    """With run.profile_steps: the planner's bytes for the fullest rank, by kind, which the worker
    writes beside its memory snapshot (the memory model reads no hardware figure: any profile)."""
    if not cfg.run.profile_steps:
        return None
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import PROFILES

    return predict(cfg, PROFILES["h100"])["memory_bytes"]


def _start_layout(cfg: Config, node_id: str, hardware: dict | None) -> tuple[Config, list[str]]:
    """This start's layout: an elastic run's dp follows the workers Ray started (config.elastic);
    with layout=auto (``hardware`` given) the planner picks all of it for them (launch.plan.autolayout)."""
    import ray.train

    if cfg.fault_tolerance.enabled:  # the workers are one replica group (engine.worker sizes it)
        return cfg, []
    if hardware is None:
        return at_world(cfg, ray.train.get_context().get_world_size()), []
    from raytrain_hybrid.launch.plan.autolayout import group_layout
    from raytrain_hybrid.planner.hardware import Hardware

    return group_layout(cfg, node_id, Hardware(**hardware))


def preemption_notice():
    """A cheap look, before every step, at whether Ray Train's preemption watcher told this worker
    that a node of the group is being drained (a spot reclaim): its own flag, no collective
    (``ray.train.get_preemption_info()`` is a barrier through an actor; the engine's vote rides
    on the step's loss all-reduce instead). Ray Train V2 internals of Ray 2.60: without them,
    no notice (a preemption then costs the steps since the newest checkpoint)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        context = get_train_context().preemption_context
    except (ImportError, AttributeError, RuntimeError):
        return None
    return lambda: context.preemption_info is not None


def notice_event(done: int, saved: bool | None) -> PreemptionEvent:
    """What the driver hears of a preemption notice: when the ranks agreed on it (``saved`` None;
    rank 0's copy of Ray Train's info), then once its save is complete."""
    if saved is not None:
        return PreemptionEvent(done, saved=saved, saved_at=time.time())
    from ray.train.v2._internal.execution.context import get_train_context

    info = get_train_context().preemption_context.preemption_info
    if info is None:
        return PreemptionEvent(done, noticed_at=time.time())
    return PreemptionEvent(
        done,
        noticed_at=time.time(),
        nodes=info.preempted_node_ids,
        ranks=info.preempted_ranks,
        deadline_ms=info.deadline_ms,
    )


def _restart_point(plan) -> tuple[str | None, bool]:
    """Where this worker group starts, and whether Ray Train has not heard of that checkpoint:
    this launch's newest complete checkpoint on storage after a restart, else the checkpoint
    given with --resume (``plan.resume``), else nothing.

    Storage, not ray.train.get_checkpoint(), says which is newest: a save completes (its
    manifest written) some time before every rank reports it to Ray Train, at a later step
    boundary when it is saved in the background, and a node lost in between would otherwise
    send the run back to the checkpoint before (or to step 0). Every rank reads the same
    listing: the worker group before this one is gone. Checkpoints of an earlier launch into
    the same directory (a run continued in place) are told apart by the manifest's launch id."""
    import ray.train

    latest = ray.train.get_checkpoint()
    heard = posixpath.basename(latest.path.rstrip("/")) if latest is not None else None
    for path in reversed(step_dirs(open_store(plan.cfg.run.output_dir).child("checkpoints"))):
        if not path.child(MANIFEST).exists() or read_manifest(path).get("launch_id") != plan.launch_id:
            continue
        try:  # sizes and metadata (a listing and one small file): a damaged one falls back to the one before
            verify(path, digests=False)
        except ConfigError as exc:
            print(f"restart: skipping {path.name}: {exc}", flush=True)
            continue
        return path.uri, path.name != heard
    return plan.resume, False


def _register(path: str | None, metrics: dict) -> None:
    """Report ``metrics`` and a checkpoint already on storage to Ray Train (``path`` on rank 0,
    None elsewhere; a barrier: every rank calls it). Ray Train gets it on its own filesystem
    (its run directory is run.output_dir/checkpoints): nothing is uploaded."""
    import ray.train
    from ray.train import Checkpoint
    from ray.train.v2.api.report_config import CheckpointUploadMode

    ckpt = None
    if path is not None:
        storage = ray.train.get_context().get_storage()
        name = posixpath.basename(path.rstrip("/"))
        ckpt = Checkpoint(posixpath.join(storage.experiment_fs_path, name), filesystem=storage.storage_filesystem)
    ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
