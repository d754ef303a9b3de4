"""`torchrun --nproc-per-node N -m raytrain_hybrid.cli train CONFIG`: a run without Ray.

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR; each joins
the default process group and runs the worker loop Ray Train's workers run
(engine.worker.run_worker). Rank 0 plays the driver's part: it takes run.output_dir's lease,
checks the resume and the input as `train` does before Ray starts, says the start line and
the progress, and writes the run directory's files (config.json, metrics.jsonl, summary.json,
TensorBoard, checkpoints under checkpoints/), so that `--resume` and `export` read a torchrun
run as a Ray one. The input is read in the replica leaders' processes (data.local_rows), in the
order Ray Data reads it. A layout chosen by the planner (parallelism.layout="auto") and elastic
runs (parallelism.min_dp) need Ray's cluster view and are refused here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import time

from raytrain_hybrid.checkpoint.manifest import MANIFEST, read_manifest, step_dirs
from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic
from raytrain_hybrid.engine.hang import nccl_env, set_env
from raytrain_hybrid.errors import ConfigError, LayoutError, redact
from raytrain_hybrid.launch.records.events import CheckpointEvent, DoneEvent, StartEvent, StepEvent
from raytrain_hybrid.launch.records.summary import done_line

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def under_torchrun() -> bool:
    """Started by torchrun (or any launcher that sets torch.distributed's environment)."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def torchrun_train(cfg: Config, resume: str | None = None, allow_change: list[str] | None = None) -> int | None:
    """The run under torchrun, its exit code (0, 1 failed, 2 refused, 130 Ctrl-C, 143 SIGTERM);
    None when this process was not started by torchrun (the run goes to Ray)."""
    if not under_torchrun():
        return None
    import torch.distributed as dist

    from raytrain_hybrid.launch.runtime.driver import sigterm_ends_the_run

    launched = _process_start()
    rank = int(os.environ["RANK"])
    use_gpu = _join(cfg)
    try:
        with sigterm_ends_the_run():
            return _run(cfg, rank, use_gpu, resume, allow_change, launched)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 (psutil missing: the launcher's own start is not counted)
        return time.time()


def _join(cfg: Config) -> bool:
    """The default process group, over torchrun's rendezvous; whether the ranks use GPUs."""
    import torch
    import torch.distributed as dist

    use_gpu = cfg.cluster.use_gpu if cfg.cluster.use_gpu is not None else torch.cuda.is_available()
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")
    if use_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    if "nccl" in backend:
        set_env(nccl_env(cfg))  # run.hang_timeout_s: NCCL's flight recorder, before the group is made
    dist.init_process_group(backend)
    return use_gpu


def _run(cfg: Config, rank: int, use_gpu: bool, resume, allow_change, launched: float) -> int:
    import torch.distributed as dist

    marks = {"launched": launched}
    prepared, lease, error = None, None, None
    if rank == 0:
        try:
            prepared, lease = _prepare(cfg, resume, allow_change, use_gpu, marks)
        except _NothingLeft:
            error = ("finished", "")
        except (ConfigError, LayoutError) as exc:
            error = ("refused", str(exc))
        except Exception as exc:  # the others must not wait for a plan that will not come
            error = ("failed", f"{type(exc).__name__}: {exc}")
    message = [{"error": error, "plan": prepared and prepared["plan"].for_workers()}]
    dist.broadcast_object_list(message, src=0)
    if message[0]["error"] is not None:
        kind, text = message[0]["error"]
        if kind == "finished":  # a resume with nothing left to train: the records completed (said)
            dist.barrier()
            return 0
        if rank == 0:
            print(redact(f"error: {text}" if kind == "refused" else f"error: training failed: {text}"), file=sys.stderr)
        dist.barrier()  # every rank ends after rank 0 has said why (torchrun stops the others at the first exit)
        return 2 if kind == "refused" else 1
    try:
        return _train(rank, message[0]["plan"], prepared, marks)
    finally:
        if lease is not None:
            lease.release()


class _NothingLeft(Exception):
    """A resume of a run that has done all its steps, whose records rank 0 completed."""


def _prepare(cfg: Config, resume, allow_change, use_gpu: bool, marks: dict):
    """Rank 0, before any rank builds anything: what `train` checks before Ray starts, and the
    run directory made. Returns (what rank 0 keeps, the lease)."""
    from raytrain_hybrid.launch.plan.inputs import finish_input, steps_to_train
    from raytrain_hybrid.launch.plan.placement import worker_resources
    from raytrain_hybrid.launch.records.lease import acquire
    from raytrain_hybrid.launch.runtime.start import RunPlan, check_before_ray, prepare_run_dir
    from raytrain_hybrid.storage import open_store

    par, world = cfg.parallelism, int(os.environ["WORLD_SIZE"])
    if par.layout == "auto" or is_elastic(par):
        key, value = ("parallelism.layout", par.layout) if par.layout == "auto" else ("parallelism.min_dp", par.min_dp)
        raise ConfigError(key, value, "needs Ray's view of the cluster; under torchrun give a fixed layout")
    if cfg.fault_tolerance.enabled:
        from raytrain_hybrid.launch.runtime.lighthouse import group_launch

        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        cfg = group_launch(cfg, world, "torchrun --nproc-per-node", restart)
    elif par.world_size != world:
        raise ConfigError(
            "parallelism",
            f"dp={par.dp} cp={par.cp} tp={par.tp} pp={par.pp}",
            f"makes {par.world_size} ranks, but torchrun started {world}: run torchrun --nproc-per-node "
            f"{par.world_size}, or change the layout",
        )
    said: list[str] = []

    def say(line: str) -> None:
        said.append(redact(line))
        print(said[-1], flush=True)

    asked, out = cfg, open_store(cfg.run.output_dir)
    fresh = not out.exists()
    lease = acquire(out.uri)
    try:
        cfg, point = prepare_run_dir(cfg, resume, allow_change, say)
        if point.finished:  # nothing left to train: the run's records completed (said), no rank trains
            from raytrain_hybrid.launch.records.rundir import complete_records

            complete_records(cfg, point)
            raise _NothingLeft
        lease.start_renewing()
        cfg, data = check_before_ray(cfg, say)
        if data.shipped and not data.checked:  # the shipped corpus unprepared: tokenized in the leaders (no Ray Data)
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path="builtin"))
            data = dataclasses.replace(data, path="builtin")
        else:
            finish_input(cfg, data, say)
        open_store(cfg.run.output_dir).makedirs()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        placement = [local] * (world // local)
        end = steps_to_train(cfg)
        resources = worker_resources(cfg, use_gpu)
        plan = RunPlan(cfg, point, None, use_gpu, resources, [world], placement, None, end, asked=asked, data=data)
    except BaseException:
        lease.release()
        if fresh and out.local:  # a refused run leaves no empty directory behind
            with contextlib.suppress(OSError):
                os.rmdir(out.path)
        raise
    for line in plan.lines():
        say(line.replace(" workers (", " torchrun processes (", 1))
    if cfg.fault_tolerance.enabled:
        from raytrain_hybrid.config.fault_tolerance import replica_groups
        from raytrain_hybrid.engine.replicas import lighthouse_address

        ft = cfg.fault_tolerance
        say(
            f"fault tolerance: replica group {ft.replica_group} of {replica_groups(cfg.parallelism)} ({world} "
            f"processes), quorum at {lighthouse_address(cfg)}, at least {ft.min_replicas} group(s) a step"
        )
    marks["input_checked"] = time.time()
    return {"plan": plan, "said": said}, lease


def _train(rank: int, plan, prepared: dict | None, marks: dict) -> int:
    """Every rank: the worker loop of ``plan`` (engine.plan.WorkerPlan, rank 0's broadcast); rank 0
    also records the run as the Ray driver does."""
    marks["worker_entered"], marks["cpu_worker_entered"] = time.time(), time.process_time()  # (as launch.runtime.entry)
    from raytrain_hybrid.engine.plan import WorkerIO
    from raytrain_hybrid.engine.worker import mark, run_worker
    from raytrain_hybrid.launch.runtime.driver import how_ended, write_results
    from raytrain_hybrid.models import get_arch

    cfg = plan.cfg
    import torch

    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    get_arch(cfg.model.arch).import_model_code()
    mark(marks, "worker_imported")
    record = _Record(cfg, prepared, plan.resume) if rank == 0 else None
    feeds = cfg.data.path != "memory"
    io = WorkerIO(
        on_step=record.step if record else None,
        dataset_fn=(lambda: _rows(cfg, cfg.data.path)) if feeds else None,
        val_fn=(lambda: _rows(cfg, cfg.data.val_path)) if feeds and cfg.data.val_path else None,
        on_checkpoint=record.checkpoint if record else None,
        marks=marks,
    )
    try:
        result = run_worker(plan, socket.gethostname(), io)
    except BaseException as exc:
        if record is None:  # rank 0 says how the run ended; the others end quietly on a signal
            if isinstance(exc, KeyboardInterrupt):
                return _exit_code(exc)
            raise
        with contextlib.suppress(Exception):
            record.log.close()
            write_results(cfg, record.log, marks, record.run_dir, ended=how_ended(exc))
        return _said_how(exc, cfg)
    if record is None:
        return 0
    record.log.handle(DoneEvent(result["memory"], result["marks"]))
    record.log.close()
    summary = write_results(cfg, record.log, marks, record.run_dir)
    print(done_line(summary, cfg.run.output_dir), flush=True)
    return 0


def _exit_code(exc: KeyboardInterrupt) -> int:
    from raytrain_hybrid.launch.runtime.driver import Terminated

    return 143 if isinstance(exc, Terminated) else 130


def _said_how(exc: BaseException, cfg: Config) -> int:
    """Rank 0's one line for a run that did not complete, and its exit code."""
    from raytrain_hybrid.launch.runtime.driver import how_ended

    if isinstance(exc, KeyboardInterrupt):
        print(f"{how_ended(exc)}: the run stopped; what it wrote is in {cfg.run.output_dir}", file=sys.stderr)
        return _exit_code(exc)
    print(redact(f"error: training failed: {type(exc).__name__}: {exc}"), file=sys.stderr, flush=True)
    return 1


def _rows(cfg: Config, path: str):
    from raytrain_hybrid.data import local_rows

    if cfg.data.text_columns:
        return local_rows.rows_of(cfg, path)
    if path == "builtin":
        return local_rows.builtin_corpus(cfg)
    return local_rows.train_rows(cfg)


class _Record:
    """Rank 0's records of the run: config.json, metrics.jsonl, TensorBoard, checkpoint.keep."""

    def __init__(self, cfg: Config, prepared: dict, resume: str | None) -> None:
        from raytrain_hybrid.launch.records.progress import RunLog
        from raytrain_hybrid.launch.records.rundir import RunDir
        from raytrain_hybrid.launch.runtime.driver import write_config

        self.cfg = cfg
        self.run_dir = RunDir.open(cfg.run.output_dir, fresh=True)
        write_config(cfg, self.run_dir)
        plan = prepared["plan"]
        self.log = RunLog(
            self.run_dir.local,
            steps=plan.end,
            progress=cfg.run.progress,
            history=plan.point.history,
            on_checkpoint=self.run_dir.sync,
            said=prepared["said"],
        )
        self.log.handle(StartEvent.of(read_manifest(resume)["step"] if resume else 0, cfg))

    def step(self, metrics: dict) -> None:
        self.log.handle(StepEvent(metrics))

    def checkpoint(self, steps_done: int, path, metrics: dict) -> None:
        self.log.handle(CheckpointEvent.of(steps_done, path, metrics))
        keep = self.cfg.checkpoint.keep  # Ray Train prunes under Ray; here, rank 0 once a save is complete
        if keep:
            root = self.run_dir.store.child("checkpoints")
            complete = [p for p in step_dirs(root) if p.child(MANIFEST).exists()]
            for old in complete[:-keep]:
                old.delete()
