"""The body of one training worker, given an initialised default process group.

Ray Train's ``train_loop_per_worker`` (launcher.py) calls :func:`run_worker`;
so can ``torchrun`` (tests of the engine without Ray).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_hybrid import checkpoint
from raytrain_hybrid.config import Config
from raytrain_hybrid.data import Batch, TokenWindows, tokenize_corpus
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
from raytrain_hybrid.distributed.utils import mesh_device
from raytrain_hybrid.evaluation import ValidationSet, evaluate
from raytrain_hybrid.rows import BUILTIN_TRAIN, RowBatches, feed_schema, read_parquet_rows, schema_buffers, to_batch
from raytrain_hybrid.trainer import Trainer


def pick_device(use_gpu: bool) -> torch.device:
    if use_gpu and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


class ReplicaFeed:
    """The step's rows for this replica: its leader reads the Ray Data stream, the other
    tp*pp ranks of the replica receive them by broadcast. A status goes first, so that the
    end of the data or a reading error stops every rank of the replica together.

    The broadcast of step k+1 is posted as soon as step k's rows arrive, so it travels while
    step k computes and the ranks behind the leader in the pipeline do not wait for it.
    """

    OK, END, ERROR = 1, 0, 2

    def __init__(self, cfg: Config, meshes, dims: ParallelDims, dp_rank: int, dataset_fn, skip_steps: int = 0) -> None:
        from raytrain_hybrid.data_ray import replica_stream

        self.group = meshes.replica.get_group()
        self.leader = meshes.replica.get_local_rank() == 0
        self.schema = feed_schema(cfg, cfg.train.global_batch_size // dims.dp)
        self.device = mesh_device(meshes.world)
        self.stream = None
        if self.leader:
            self.stream = replica_stream(cfg, dataset_fn(), dp=dims.dp, dp_rank=dp_rank, skip_steps=skip_steps)
        self._pending = None
        if self.leader:
            # Read in a thread from the start: Ray Data's executor spins up while the model builds.
            self._queue: queue.Queue = queue.Queue(maxsize=2)
            threading.Thread(target=self._read, daemon=True, name="replica-reader").start()

    def _read(self) -> None:
        try:
            for rows in self.stream:
                self._queue.put(rows)
            self._queue.put(StopIteration())
        except Exception as exc:  # handed to the training thread, which broadcasts it
            self._queue.put(exc)

    def _post(self):
        status = torch.zeros(1, dtype=torch.int64, device=self.device)
        arrays = error = None
        if self.leader:
            item = self._queue.get()
            if isinstance(item, StopIteration):
                status.fill_(self.END)
            elif isinstance(item, Exception):  # still broadcast, so the replica does not hang
                status.fill_(self.ERROR)
                error = item
            else:
                arrays = item if isinstance(item, dict) else {"tokens": item}
                status.fill_(self.OK)
        bufs = schema_buffers(self.schema, self.device, arrays)
        works = [dist.broadcast(t, group=self.group, group_src=0, async_op=True) for t in (status, *bufs.values())]
        return status, bufs, works, error

    def next(self) -> Batch | None:
        status, bufs, works, error = self._pending or self._post()
        self._pending = None
        for work in works:
            work.wait()
        code = int(status.item())
        if code == self.ERROR:
            raise error if error is not None else RuntimeError("this replica's data leader failed reading")
        if code == self.END:
            return None
        self._pending = self._post()  # prefetch the next step's rows
        return to_batch({k: v.cpu() for k, v in bufs.items()})

    def close(self) -> None:
        """Complete the prefetch in flight (every rank of the replica posted it)."""
        if self._pending is not None:
            for work in self._pending[2]:
                work.wait()
            self._pending = None


def run_worker(
    cfg: Config,
    node_id: str,
    *,
    use_gpu: bool = False,
    on_step: Callable[[dict], None] | None = None,
    device: torch.device | None = None,
    dataset_fn: Callable[[], object] | None = None,
    val_fn: Callable[[], object] | None = None,
    resume: str | None = None,
    launch_id: str = "",
    on_checkpoint: Callable[[int, Path, dict], None] | None = None,
    marks: dict | None = None,
) -> dict:
    """Train up to ``cfg.train.steps`` steps; returns per-step metrics and this rank's memory stats.

    ``dataset_fn`` returns this rank's Ray Data iterator (called by replica leaders only);
    without it the input is the shipped corpus, windowed in memory (engine tests without Ray),
    or for classifiers the shipped rows. ``val_fn``, likewise, the validation rows' iterator
    (classifiers evaluate every ``train.eval_interval`` steps and after the last).
    ``resume`` is a verified checkpoint directory to continue from (model, optimizer, LR
    schedule, RNG, data position); with ``checkpoint.interval`` the run saves its own, and
    ``on_checkpoint(steps_done, directory, metrics)`` runs on every rank after each save.
    ``marks`` collects wall-clock times of the start-up phases (rank 0's are reported).
    """
    marks = marks if marks is not None else {}
    par = cfg.parallelism
    dims = ParallelDims(dp=par.dp, tp=par.tp, pp=par.pp, zero=par.zero)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != dims.world_size:
        raise RuntimeError(f"{world} workers started for a layout of {dims.world_size}")
    nodes: list[str] = [""] * world
    dist.all_gather_object(nodes, node_id)
    marks["group_ready"] = time.time()
    arrangement = arrange_ranks(dims, nodes)
    device = device or pick_device(use_gpu)
    mesh = dims.build_mesh(device.type, arrangement)
    start = checkpoint.read_manifest(resume)["step"] if resume else 0
    if dataset_fn is not None:  # before the model: the reader starts while the model builds
        feed = ReplicaFeed(cfg, mesh, dims, mesh.dp.get_local_rank(), dataset_fn, skip_steps=start)
    marks["mesh_built"] = time.time()
    trainer = Trainer(cfg, dims, mesh, device)
    marks["model_built"] = time.time()
    if resume:
        checkpoint.load(trainer, cfg, resume)
        marks["checkpoint_loaded"] = time.time()
    if dataset_fn is not None:
        next_batch = lambda step: feed.next()  # noqa: E731
    else:
        if trainer.spec.task == "lm":
            data = TokenWindows(tokenize_corpus(tokenizer=cfg.data.tokenizer), cfg.model.seq_len, cfg.train.seed)
        else:
            data = RowBatches(read_parquet_rows(BUILTIN_TRAIN, cfg), cfg.train.seed)
        next_batch = lambda step: data.replica_batch(step, cfg.train.global_batch_size, dims.dp, trainer.dp_rank)  # noqa: E731
    validation = None
    if trainer.spec.task != "lm":
        validation = ValidationSet.open(cfg, mesh, val_fn=val_fn, in_memory=dataset_fn is None)
    every = cfg.train.eval_interval
    history = []
    digest = hashlib.sha256()  # of every row this rank trained on: replicas' ranks must agree
    rows = 0
    waited = busy = 0.0
    interval = cfg.checkpoint.interval
    for step in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        batch = next_batch(step)
        wait = time.perf_counter() - t0
        if batch is None:  # data.epochs ran out before train.steps
            break
        marks.setdefault("first_batch", time.time())
        digest.update(batch.input_ids.numpy().tobytes())
        rows += batch.input_ids.shape[0]
        metrics = trainer.train_step(step, batch)
        marks.setdefault("first_step_done", time.time())
        metrics["data_wait_s"] = wait
        if step > start:  # the first batch waits for the pipeline to start: not steady state
            waited, busy = waited + wait, busy + wait + metrics["step_time_s"]
        if dataset_fn is not None and feed.stream is not None:
            pos = feed.stream.position
            metrics.update(data_epoch=pos.epoch, data_windows_in_epoch=pos.windows_in_epoch)
        if validation is not None and ((every and (step + 1) % every == 0) or step + 1 == cfg.train.steps):
            metrics.update(evaluate(trainer, validation))
        history.append(metrics)
        if on_step is not None and rank == 0:
            on_step(metrics)
        done = step + 1
        if interval and (done % interval == 0 or done == cfg.train.steps):
            position = dataclasses.asdict(feed.stream.position) if dataset_fn is not None and feed.stream else {}
            path, timings = checkpoint.save(trainer, cfg, done, launch_id=launch_id, data_position=position)
            metrics.update(timings)  # this rank's history (the driver hears of it from on_checkpoint)
            if on_checkpoint is not None:
                on_checkpoint(done, path, metrics)
    if dataset_fn is not None:
        feed.close()
    coords = {"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": mesh.tp.get_local_rank()}
    per_rank = [None] * world
    inputs = {
        "input_digest": digest.hexdigest()[:16],
        "input_rows": rows,
        "data_wait_fraction": waited / busy if busy else None,
    }
    dist.all_gather_object(per_rank, {"rank": rank, "node": node_id, **coords, **inputs, **trainer.memory_stats()})
    return {"history": history, "memory": per_rank, "coords": coords, "marks": marks}
