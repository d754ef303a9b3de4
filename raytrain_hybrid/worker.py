"""The body of one training worker, given an initialised default process group.

Ray Train's ``train_loop_per_worker`` (launcher.py) calls :func:`run_worker`;
so can ``torchrun`` (tests of the engine without Ray).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from raytrain_hybrid.config import Config
from raytrain_hybrid.data import TokenWindows, tokenize_corpus
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
from raytrain_hybrid.trainer import Trainer


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
) -> dict:
    """Train ``cfg.train.steps`` steps; returns per-step metrics and this rank's memory stats."""
    par = cfg.parallelism
    dims = ParallelDims(dp=par.dp, tp=par.tp, pp=par.pp, zero=par.zero)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != dims.world_size:
        raise RuntimeError(f"{world} workers started for a layout of {dims.world_size}")
    nodes: list[str] = [""] * world
    dist.all_gather_object(nodes, node_id)
    arrangement = arrange_ranks(dims, nodes)
    device = device or pick_device(use_gpu)
    mesh = dims.build_mesh(device.type, arrangement)
    trainer = Trainer(cfg, dims, mesh, device)
    data = TokenWindows(tokenize_corpus(cfg.data.corpus, cfg.data.tokenizer), cfg.model.seq_len, cfg.train.seed)
    history = []
    for step in range(cfg.train.steps):
        batch = data.replica_batch(step, cfg.train.global_batch_size, dims.dp, trainer.dp_rank)
        metrics = trainer.train_step(step, batch)
        history.append(metrics)
        if on_step is not None and rank == 0:
            on_step(metrics)
    coords = {"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": mesh.tp.get_local_rank()}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "node": node_id, **coords, **trainer.memory_stats()})
    return {"history": history, "memory": per_rank, "coords": coords}
