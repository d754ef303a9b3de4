"""The body of one training worker, given an initialised default process group.

Ray Train's ``train_loop_per_worker`` (launch.entry) calls :func:`run_worker`;
so can plain gloo processes (tests of the engine without Ray).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_hybrid.checkpoint.manifest import read_manifest
from raytrain_hybrid.checkpoint.state import load_checkpoint, save_checkpoint
from raytrain_hybrid.config import Config
from raytrain_hybrid.data.corpus import TokenWindows, tokenize_corpus
from raytrain_hybrid.data.rows import BUILTIN_TRAIN, RowBatches, read_parquet_rows
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
from raytrain_hybrid.engine.evaluation import ValidationSet, evaluate
from raytrain_hybrid.engine.feed import ReplicaFeed
from raytrain_hybrid.engine.trainer import Trainer


def pick_device(use_gpu: bool) -> torch.device:
    if use_gpu and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


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
    dims = ParallelDims.from_config(par)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != dims.world_size:
        raise RuntimeError(f"{world} workers started for a layout of {dims.world_size}")
    nodes: list[str] = [""] * world
    dist.all_gather_object(nodes, node_id)
    marks["group_ready"] = time.time()
    arrangement = arrange_ranks(dims, nodes)
    device = device or pick_device(use_gpu)
    mesh = dims.build_mesh(device.type, arrangement)
    start = read_manifest(resume)["step"] if resume else 0
    if dataset_fn is not None:  # before the model: the reader starts while the model builds
        feed = ReplicaFeed(cfg, mesh, dims, mesh.dp.get_local_rank(), dataset_fn, skip_steps=start)
    marks["mesh_built"] = time.time()
    trainer = Trainer(cfg, dims, mesh, device)
    marks["model_built"] = time.time()
    if resume:
        load_checkpoint(trainer, cfg, resume)
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
            path, timings = save_checkpoint(trainer, cfg, done, launch_id=launch_id, data_position=position)
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
