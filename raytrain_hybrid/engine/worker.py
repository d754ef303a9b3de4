"""The body of one training worker, given an initialised default process group.

Ray Train's ``train_loop_per_worker`` (launch.runtime.entry) calls :func:`run_worker`;
so can plain gloo processes (tests of the engine without Ray). Its steps: join the
layout's mesh, choose the input (a replica feed from Ray Data, or data held in memory),
build the trainer, run the step loop (checkpoints on interval), gather every rank's report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from raytrain_hybrid.checkpoint.manifest import read_manifest
from raytrain_hybrid.checkpoint.save import CheckpointWriter, Saved
from raytrain_hybrid.checkpoint.state import load_checkpoint
from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import at_world
from raytrain_hybrid.config.fault_tolerance import replica_groups
from raytrain_hybrid.data.corpus import Batch, TokenWindows, tokenize_corpus
from raytrain_hybrid.data.rows import BUILTIN_TRAIN, RowBatches, read_parquet_rows
from raytrain_hybrid.data.stream import StreamPosition
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
from raytrain_hybrid.engine.compile_cache import CompileCache
from raytrain_hybrid.engine.evaluation import ValidationSet, evaluate
from raytrain_hybrid.engine.feed import ReplicaFeed
from raytrain_hybrid.engine.hang import HangWatch
from raytrain_hybrid.engine.hang import start as watch_hangs
from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
from raytrain_hybrid.engine.profile import StepProfiler
from raytrain_hybrid.engine.replicas import ReplicaSync, StepBatches, group_config
from raytrain_hybrid.engine.trainer import Trainer
from raytrain_hybrid.storage import Store

NextBatch = Callable[[int], Batch | None]  # step -> this replica's batch; None: the data ran out


def mark(marks: dict, name: str) -> None:
    """A start-up phase's end, once: the wall clock, and this process's CPU seconds so far as
    ``cpu_<name>`` (where there are fewer cores than workers, CPU is what a start costs)."""
    if name not in marks:
        marks[name], marks["cpu_" + name] = time.time(), time.process_time()


def pick_device(use_gpu: bool) -> torch.device:
    if use_gpu and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def run_worker(plan: WorkerPlan, node_id: str, io: WorkerIO | None = None) -> dict:
    """Train ``plan``'s run up to ``train.steps`` steps (or ``plan.end``) on this rank of the
    process group; returns per-step metrics and this rank's memory stats. ``io``: where the input
    comes from and whom the worker tells (:class:`WorkerIO`)."""
    io = io or WorkerIO()
    cfg, use_gpu, resume, marks = plan.cfg, plan.use_gpu, plan.resume, io.marks
    # An elastic run (parallelism.min_dp) starts at the dp its workers make: the same steps,
    # each replica accumulating more or fewer micro-batches (config.elastic).
    # [fault_tolerance]: this process group is one replica group, training its share of each batch.
    full = cfg
    if cfg.fault_tolerance.enabled:
        cfg = group_config(cfg)
    cfg = at_world(cfg, dist.get_world_size())
    hang = watch_hangs(cfg)  # run.hang_timeout_s: on before any collective of ours
    dims, mesh, device = join_mesh(cfg, node_id, use_gpu, io.device, marks)
    manifest = read_manifest(resume) if resume else {}
    start = manifest.get("step", 0)
    origin = manifest.get("data_origin", 0) if plan.data_origin is None else plan.data_origin
    # Where the skipped stream must stand: the checkpoint's own position, if its data goes on.
    expect = manifest.get("data_position") if origin == manifest.get("data_origin", 0) else None
    feed = None
    if io.dataset_fn is not None and not full.fault_tolerance.enabled:  # before the model: read while it builds
        dp_rank = mesh.dp.get_local_rank()
        feed = ReplicaFeed(cfg, mesh, dims, dp_rank, io.dataset_fn, skip_steps=start - origin, expect=expect)
    mark(marks, "mesh_built")
    trainer = Trainer(cfg, dims, mesh, device)
    mark(marks, "model_built")
    if resume:
        load_checkpoint(trainer, cfg, resume)
        mark(marks, "checkpoint_loaded")
    compile_cache = CompileCache.open(cfg, trainer)  # a compiled run's kernels, kept in its run directory
    if compile_cache is not None:
        marks["compile_cache_loaded"] = compile_cache.load()
    # The data in memory knows where its passes (data.epochs) end; Ray Data's streams tell the driver.
    next_batch, data_end = in_memory_batches(cfg, trainer) if feed is None else ((lambda step: feed.next()), None)
    replicas = None
    if full.fault_tolerance.enabled:  # the quorum decides the step; the input follows it
        replicas, next_batch, feeds = replica_group_input(full, trainer, io.dataset_fn, origin, start)
        trainer.replicas = replicas
    end = min(plan.end or cfg.train.steps, data_end or cfg.train.steps)
    validation = None
    if trainer.spec.task != "lm":
        validation = ValidationSet.open(cfg, mesh, val_fn=io.val_fn, in_memory=feed is None)
    loop = StepLoop(
        cfg,
        trainer,
        next_batch,
        position=(lambda: feed.position) if feed is not None else (lambda: None),
        validation=validation,
        on_step=io.on_step if dist.get_rank() == 0 else None,
        on_checkpoint=io.on_checkpoint,
        writer=CheckpointWriter(cfg, plan.launch_id, plan.trajectory, origin) if cfg.checkpoint.interval else None,
        marks=marks,
        notice=io.notice,
        on_notice=io.on_notice,
        end=end,
        profiler=StepProfiler.open(cfg, trainer, start, io.predicted_memory),
        compile_cache=compile_cache,
        hang=hang,
        replicas=replicas,
    )
    if replicas is not None and io.dataset_fn is not None:
        loop.position = lambda: feeds[-1].position
    loop.run(start)
    if replicas is not None:
        replicas.close()
        for f in feeds:
            f.close()
    if hang is not None:
        hang.close()
    if feed is not None:
        feed.close()
    coords, per_rank = gather_reports(trainer, node_id, loop.inputs_report())
    out = {"history": loop.history, "memory": per_rank, "coords": coords, "marks": marks}
    return {**out, "noticed_at": loop.noticed_at}


def join_mesh(cfg: Config, node_id: str, use_gpu: bool, device: torch.device | None, marks: dict):
    """This rank's place in the layout: (dims, mesh, device), TP groups kept inside a node."""
    dims = ParallelDims.from_config(cfg.parallelism)
    world = dist.get_world_size()
    if world != dims.world_size:
        raise RuntimeError(f"{world} workers started for a layout of {dims.world_size}")
    nodes: list[str] = [""] * world
    dist.all_gather_object(nodes, node_id)
    mark(marks, "group_ready")
    arrangement = arrange_ranks(dims, nodes)
    device = device or pick_device(use_gpu)
    return dims, dims.build_mesh(device.type, arrangement), device


def replica_group_input(full: Config, trainer: Trainer, dataset_fn, origin: int, start: int):
    """[fault_tolerance]: this group's side of the quorum, and its input as a function of the step
    the quorum gives: the rows the same dp ranks of the whole layout read (group g's shard ranks
    are dp ranks g*shard .. of it). Returns (the sync, next_batch, the feeds opened so far)."""
    groups = replica_groups(full.parallelism)
    group = full.fault_tolerance.replica_group
    dims = trainer.dims
    whole = dataclasses.replace(dims, dp=dims.dp * groups)
    rank = group * dims.dp + trainer.dp_rank
    replicas = ReplicaSync(full, trainer, group, trainer.device, start)
    feeds: list[ReplicaFeed] = []

    def open_at(step: int) -> NextBatch:
        if dataset_fn is None:
            return in_memory_batches(full, trainer, whole.dp, rank)[0]
        for f in feeds:  # a rejoining group starts its input again at the step it was given
            f.close()
        feeds.append(ReplicaFeed(full, trainer.mesh, whole, rank, dataset_fn, skip_steps=step - origin))
        return lambda _step: feeds[-1].next()

    return replicas, StepBatches(open_at, start), feeds


def in_memory_batches(
    cfg: Config, trainer: Trainer, dp: int | None = None, dp_rank: int | None = None
) -> tuple[NextBatch, int | None]:
    """Without Ray Data: the shipped corpus in token windows (LMs), or the shipped rows; chat or
    prompt/completion examples (data.format) from data.path, read in this process. With
    data.epochs, None once the passes' global batches are trained, as the streams end; returned
    with that step count (None: not known up front, or no data.epochs). ``dp``, ``dp_rank``: the
    rows of that replica of that many (default: the trainer's)."""
    dp = trainer.dims.dp if dp is None else dp
    dp_rank = trainer.dp_rank if dp_rank is None else dp_rank
    if cfg.data.format != "text" or cfg.data.packing:  # examples, or the corpus's documents packed
        from raytrain_hybrid.data.examples import in_memory_examples

        return in_memory_examples(cfg, dp, dp_rank), None
    if trainer.spec.task == "lm":
        data = TokenWindows(tokenize_corpus(tokenizer=cfg.data.tokenizer), cfg.model.seq_len, cfg.train.seed)
    else:
        data = RowBatches(read_parquet_rows(BUILTIN_TRAIN, cfg), cfg.train.seed)
    gb = cfg.train.global_batch_size
    end = data.steps_in(cfg.data.epochs, gb) if cfg.data.epochs else None

    def next_batch(step: int) -> Batch | None:
        if end is not None and step >= end:
            return None
        return data.replica_batch(step, gb, dp, dp_rank)

    return next_batch, end


@dataclass
class StepLoop:
    """The step loop of one rank, and what it accumulates."""

    cfg: Config
    trainer: Trainer
    next_batch: NextBatch
    # Where the stream stood after the step just trained (replica leaders reading Ray Data; else None).
    position: Callable[[], StreamPosition | None]
    validation: ValidationSet | None
    on_step: Callable[[dict], None] | None  # rank 0 only
    on_checkpoint: Callable[[int, Store, dict], None] | None
    writer: CheckpointWriter | None  # with checkpoint.interval
    marks: dict
    history: list[dict] = field(default_factory=list)
    digest: Any = field(default_factory=hashlib.sha256)  # of every row trained on: a replica's ranks agree
    rows: int = 0
    waited: float = 0.0  # seconds waiting for data, after the first step
    busy: float = 0.0  # seconds waiting or stepping, after the first step
    saving: dict = field(default_factory=dict)  # step -> the metrics of a save not yet complete
    notice: Callable[[], bool] | None = None  # this rank heard of a preemption (see run_worker)
    on_notice: Callable[[int, bool | None], None] | None = None
    noticed_at: int | None = None  # the step boundary where the ranks agreed on a notice
    last_started: int = -1  # the step of the newest save started
    end: int = 0  # the steps the run trains, when known (data.epochs may end it before train.steps)
    profiler: StepProfiler | None = None  # run.profile_steps
    compile_cache: CompileCache | None = None  # parallelism.compile: written after the first step
    hang: HangWatch | None = None  # run.hang_timeout_s
    replicas: ReplicaSync | None = None  # [fault_tolerance]: the quorum gives the step

    def run(self, start: int) -> None:
        step = start
        while step < self.cfg.train.steps:
            if self.replicas is not None:  # a rejoining group continues at the live groups' step
                step = self.replicas.begin()
                if step >= self.cfg.train.steps:
                    break
            t0 = time.perf_counter()
            batch = self.next_batch(step)
            wait = time.perf_counter() - t0
            if batch is None:  # data.epochs ran out before train.steps: the run ends here,
                if self.writer is not None and self.history and self.last_started != step:
                    self.start_save(step, self.history[-1])  # and keeps its last step, as at train.steps
                break
            mark(self.marks, "first_batch")
            self.digest.update(batch.input_ids.numpy().tobytes())
            self.rows += batch.input_ids.shape[0]
            heard = self.notice is not None and self.noticed_at is None and self.notice()
            if self.profiler is not None:
                self.profiler.before(step)
            if self.hang is not None:
                self.hang.begin(step)
            metrics = self.trainer.train_step(step, batch, flag=heard)
            if self.hang is not None:
                self.hang.end()
            if not metrics.get("committed", True):  # a group failed during the step: again, same rows
                continue
            if self.profiler is not None:
                self.profiler.after(step)
            mark(self.marks, "first_step_done")
            if "compile_s" in metrics:  # torch.compile compiles at the first step: its share of it
                self.marks.setdefault("first_step_compile_s", metrics["compile_s"])
            if self.compile_cache is not None:
                self.compile_cache.after_step(metrics)
            metrics["data_wait_s"] = wait
            if step > start:  # the first batch waits for the pipeline to start: not steady state
                self.waited, self.busy = self.waited + wait, self.busy + wait + metrics["step_time_s"]
            if (position := self.position()) is not None:
                metrics.update(position.metrics())
            if self.validation is not None and self.evaluates(step):
                metrics.update(evaluate(self.trainer, self.validation))
            self.history.append(metrics)
            if self.on_step is not None:
                self.on_step(metrics)
            self.checkpoint_if_due(step + 1, metrics)
            if self.trainer.flagged and self.noticed_at is None:
                self.save_before_preemption(step + 1, metrics)
            step += 1
        if self.profiler is not None:  # a window the data cut short: written as it stands
            self.profiler.close()
        if self.writer is not None:  # the run does not end with a save in flight
            self.completed(self.writer.close())

    def evaluates(self, step: int) -> bool:
        every = self.cfg.train.eval_interval
        return bool(every and (step + 1) % every == 0) or step + 1 == (self.end or self.cfg.train.steps)

    def checkpoint_if_due(self, done: int, metrics: dict) -> None:
        if self.writer is None:
            return
        self.completed(self.writer.poll())  # a background save that every rank has finished
        interval = self.cfg.checkpoint.interval
        if done % interval and done != self.cfg.train.steps:
            return
        self.start_save(done, metrics)

    def start_save(self, done: int, metrics: dict) -> None:
        position = self.position()
        since = [dict(m) for m in self.history if m["step"] >= self.last_started]  # the steps since the last save
        self.saving[done], self.last_started = metrics, done
        entry = position.manifest_entry() if position is not None else {}
        self.completed(self.writer.save(self.trainer, done, data_position=entry, steps=since))

    def save_before_preemption(self, done: int, metrics: dict) -> None:
        """Every rank, at the step where the ranks agreed that a node is about to go: the
        checkpoint of this step (unless the interval started it already) completed now, in the
        foreground: the node may be gone before a background save would end."""
        self.noticed_at = done
        if self.on_notice is not None:  # heard now: the save may outlast the node's deadline
            self.on_notice(done, None)
        if self.writer is not None:
            if self.last_started != done:
                self.start_save(done, metrics)
            self.completed(self.writer.wait())
        if self.on_notice is not None:
            self.on_notice(done, self.writer is not None)

    def completed(self, saved: list[Saved]) -> None:
        """Complete checkpoints: their timings go into their step's metrics (this rank's
        history), and on_checkpoint hears of them (every rank, in step order)."""
        for s in saved:
            metrics = self.saving.pop(s.step)
            metrics.update(s.timings)
            if self.on_checkpoint is not None:
                self.on_checkpoint(s.step, s.path, metrics)

    def inputs_report(self) -> dict:
        return {
            "input_digest": self.digest.hexdigest()[:16],
            "input_rows": self.rows,
            "data_wait_fraction": self.waited / self.busy if self.busy else None,
        }


def gather_reports(trainer: Trainer, node_id: str, inputs: dict) -> tuple[dict, list[dict]]:
    """This rank's coordinates, and every rank's report (node, coordinates, inputs, memory)."""
    coords = {"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": trainer.mesh.tp.get_local_rank()}
    if trainer.dims.cp > 1:  # which slice of the sequence this rank trains on
        coords["cp"] = trainer.cp_rank
    per_rank: list = [None] * dist.get_world_size()
    mine = {"rank": dist.get_rank(), "node": node_id, **coords, **inputs, **trainer.memory_stats()}
    dist.all_gather_object(per_rank, mine)
    return coords, per_rank
