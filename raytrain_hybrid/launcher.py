"""Config -> Ray Train TorchTrainer: scaling, backend, live progress, result files.

Per-step metrics reach the driver through a Ray queue that rank 0 feeds
(``Result.metrics`` keeps only the latest checkpoint's metrics), so the driver
can draw a progress bar and write ``metrics.jsonl`` while the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from raytrain_hybrid.config import Config
from raytrain_hybrid.data_ray import ReplicaDataConfig, build_dataset, builtin_dataset, schema_check
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
from raytrain_hybrid.placement import live_node_totals, predict_workers_per_node, worker_resources

# Ray Train V2 is the default in Ray 2.60; state it so a user's environment cannot flip it.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_V2_ENABLED": "1"}


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker (the process group is already initialised)."""
    import ray
    import ray.train
    import torch

    cfg = Config.from_dict(loop_config["config"])
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    from raytrain_hybrid.worker import run_worker

    sink = loop_config.get("sink")
    node_id = ray.get_runtime_context().get_node_id()  # node IP is shared by virtual nodes
    os.environ.setdefault("LOCAL_RANK", str(ray.train.get_context().get_local_rank()))

    def on_step(metrics: dict) -> None:
        if sink is not None:
            sink.put(("step", metrics))

    result = run_worker(
        cfg,
        node_id,
        use_gpu=loop_config["use_gpu"],
        on_step=on_step,
        dataset_fn=None if cfg.data.path == "memory" else (lambda: ray.train.get_dataset_shard("train")),
    )
    if ray.train.get_context().get_world_rank() == 0 and sink is not None:
        sink.put(("done", {"memory": result["memory"]}))
    last = result["history"][-1]
    ray.train.report({"loss": last["loss"], "step": last["step"]})


def _ensure_ray(cfg: Config, world_size: int) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": _WORKER_ENV}
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
        return
    # No cluster: a private local one with enough logical CPUs for every worker
    # (plus one for Ray Train's controller), however few cores the machine has.
    need = math.ceil(world_size * cfg.cluster.cpus_per_worker) + 1
    ray.init(
        address="local",
        num_cpus=max(need, os.cpu_count() or 1),
        runtime_env=env,
        log_to_driver=False,
        include_dashboard=False,
    )


def _use_gpu(cfg: Config, world_size: int) -> bool:
    import ray

    if cfg.cluster.use_gpu is not None:
        return cfg.cluster.use_gpu
    return ray.cluster_resources().get("GPU", 0) >= world_size


def _datasets(cfg: Config) -> dict:
    if cfg.data.path == "memory":
        return {}
    return {"datasets": {"train": build_dataset(cfg)}, "dataset_config": ReplicaDataConfig()}


def prepare_input(cfg: Config) -> Config:
    """Resolve data.path ("builtin" is prepared once) and check the files before workers start."""
    if cfg.data.path == "memory":
        return cfg
    if cfg.data.path == "builtin":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=builtin_dataset(cfg)))
    schema_check(cfg)
    return cfg


def check_placement(cfg: Config, resources: dict[str, float]) -> list[int] | None:
    """Refuse, before any worker starts, a layout the live nodes cannot hold with TP inside a node.

    Returns the predicted workers per node (None when the cluster cannot hold the group
    yet, e.g. while an autoscaler adds nodes; the workers then check what they got).
    """
    par = cfg.parallelism
    dims = ParallelDims(dp=par.dp, tp=par.tp, pp=par.pp, zero=par.zero)
    counts = predict_workers_per_node(live_node_totals(), dims.world_size, resources, cfg.cluster.placement_strategy)
    if counts is not None:
        arrange_ranks(dims, [f"node{i}" for i, c in enumerate(counts) for _ in range(c)])
    return counts


class _Progress:
    """Consumes rank 0's queue: progress bar on the terminal, metrics.jsonl on disk."""

    def __init__(self, cfg: Config, out_dir: Path) -> None:
        self.cfg = cfg
        self.history: list[dict] = []
        self.memory: list[dict] = []
        self.file = (out_dir / "metrics.jsonl").open("w")
        self.bar = None
        if cfg.run.progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=cfg.train.steps, status="starting workers")
            self.bar.start()

    def handle(self, kind: str, payload: dict) -> None:
        if kind == "step":
            self.history.append(payload)
            self.file.write(json.dumps(payload) + "\n")
            self.file.flush()
            if self.bar is not None:
                status = (
                    f"loss {payload['loss']:.4f}  grad_norm {payload['grad_norm']:.3f}  "
                    f"{payload['tokens_per_s']:,.0f} tok/s"
                )
                self.bar.update(self.task, completed=payload["step"] + 1, status=status)
        elif kind == "done":
            self.memory = payload["memory"]

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.stop()


def summarize(cfg: Config, history: list[dict], memory: list[dict]) -> dict:
    par = cfg.parallelism
    # The first steps pay for warm-up (allocations, pipeline shape inference); leave them out.
    steady = history[min(2, len(history) - 1) :] if history else []
    summary = {
        "final_loss": history[-1]["loss"] if history else None,
        "steps": len(history),
        "world_size": par.world_size,
        "layout": {
            "dp": par.dp,
            "tp": par.tp,
            "pp": par.pp,
            "microbatches": par.microbatches,
            "schedule": par.schedule,
            "zero": par.zero,
            "virtual_stages": par.stages_per_rank if par.pp > 1 else 1,
            "activation_checkpointing": par.activation_checkpointing,
        },
        "model": {"arch": cfg.model.arch, "num_layers": cfg.model.num_layers, "hidden_size": cfg.model.hidden_size},
        "mean_tokens_per_s": (sum(h["tokens_per_s"] for h in steady) / len(steady)) if steady else None,
        "mean_step_time_s": (sum(h["step_time_s"] for h in steady) / len(steady)) if steady else None,
        "mean_tflops_per_device": (sum(h["tflops_per_device"] for h in steady) / len(steady)) if steady else None,
        "mean_mfu": (sum(h["mfu"] for h in steady) / len(steady)) if steady and steady[0]["mfu"] else None,
    }
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "max_rss_bytes", "data_wait_fraction"):
        summary[key] = max((m[key] for m in memory if m.get(key) is not None), default=None)
    summary["per_rank"] = memory
    return summary


def run(cfg: Config) -> dict:
    """Train on Ray; write metrics.jsonl and summary.json to run.output_dir; return the summary."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Empty, Queue

    par = cfg.parallelism
    world = par.world_size
    out_dir = Path(cfg.run.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ray(cfg, world)
    use_gpu = _use_gpu(cfg, world)
    resources = worker_resources(cfg, use_gpu)
    check_placement(cfg, resources)
    cfg = prepare_input(cfg)
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")
    sink = Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "sink": sink, "use_gpu": use_gpu},
        torch_config=TorchConfig(backend=backend),
        **_datasets(cfg),
        scaling_config=ScalingConfig(
            num_workers=world,
            use_gpu=use_gpu,
            resources_per_worker=resources,
            placement_strategy=cfg.cluster.placement_strategy,
            accelerator_type=cfg.cluster.accelerator_type or None,
        ),
        run_config=RunConfig(
            name=f"raytrain-hybrid-{int(time.time())}",
            storage_path=str(out_dir / "ray_storage"),
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised on the driver's main thread
            outcome["error"] = exc

    progress = _Progress(cfg, out_dir)
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    try:
        while thread.is_alive() or not sink.empty():
            try:
                kind, payload = sink.get(timeout=0.5)
            except Empty:
                continue
            progress.handle(kind, payload)
    finally:
        progress.close()
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    summary = summarize(cfg, progress.history, progress.memory)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    ray.kill(sink.actor)
    return summary
