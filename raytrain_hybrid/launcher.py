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

from raytrain_hybrid import checkpoint
from raytrain_hybrid.config import Config
from raytrain_hybrid.data_ray import (
    ReplicaDataConfig,
    build_dataset,
    build_rows_dataset,
    builtin_dataset,
    schema_check,
)
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.observe import RunLog
from raytrain_hybrid.placement import live_node_totals, predict_workers_per_node, worker_resources

# Ray Train V2 is the default in Ray 2.60; state it so a user's environment cannot flip it.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_V2_ENABLED": "1"}


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker (the process group is already initialised)."""
    entered = time.time()
    import ray
    import ray.train
    import torch

    cfg = Config.from_dict(loop_config["config"])
    os.environ.update(loop_config.get("data_env", {}))  # before this worker's Ray Data executor starts
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    from raytrain_hybrid.worker import run_worker

    marks = {"worker_entered": entered, "worker_imported": time.time()}

    sink = loop_config.get("sink")
    node_id = ray.get_runtime_context().get_node_id()  # node IP is shared by virtual nodes
    os.environ.setdefault("LOCAL_RANK", str(ray.train.get_context().get_local_rank()))

    rank = ray.train.get_context().get_world_rank()

    def on_step(metrics: dict) -> None:
        if sink is not None:
            sink.put(("step", metrics))

    def on_checkpoint(steps_done: int, path, metrics: dict) -> None:
        # Written in place (under Ray Train's run directory): rank 0 registers it, so that a
        # restarted worker group gets it from ray.train.get_checkpoint(), and `keep` applies.
        from ray.train import Checkpoint
        from ray.train.v2.api.report_config import CheckpointUploadMode

        report = {"loss": metrics["loss"], "step": steps_done}
        ckpt = Checkpoint(str(path)) if rank == 0 else None
        ray.train.report(report, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        if rank == 0 and sink is not None:
            timings = {k: metrics[k] for k in ("write_s", "save_s")}
            sink.put(("checkpoint", {"step": steps_done, "path": str(path), **timings}))

    result = run_worker(
        cfg,
        node_id,
        use_gpu=loop_config["use_gpu"],
        on_step=on_step,
        dataset_fn=None if cfg.data.path == "memory" else (lambda: ray.train.get_dataset_shard("train")),
        val_fn=(lambda: ray.train.get_dataset_shard("val"))
        if cfg.data.val_path and cfg.data.path != "memory"
        else None,
        resume=_restart_point(loop_config),
        launch_id=loop_config["launch_id"],
        on_checkpoint=on_checkpoint,
        marks=marks,
    )
    if ray.train.get_context().get_world_rank() == 0 and sink is not None:
        sink.put(("done", {"memory": result["memory"], "marks": result["marks"]}))
    last = result["history"][-1]
    ray.train.report({"loss": last["loss"], "step": last["step"]})


class StartupTimeout(RuntimeError):
    """The run did not reach its first step in time; the message says what Ray waits for."""


def _restart_point(loop_config: dict) -> str | None:
    """Where this worker group starts: this launch's newest checkpoint after a restart, else
    the checkpoint given with --resume, else nothing. (Ray Train also hands back checkpoints of
    an earlier launch into the same directory; the manifest's launch id tells them apart.)"""
    import ray.train

    latest = ray.train.get_checkpoint()
    if latest is not None:
        manifest = checkpoint.read_manifest(latest.path)
        if manifest.get("launch_id") == loop_config["launch_id"]:
            return latest.path
    return loop_config.get("resume")


def _runtime_env() -> dict:
    """Our worker variables, less those a submitted job's runtime env already sets: Ray
    refuses to merge a job's and a driver's runtime env that name the same variable."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}")
    taken = (job.get("runtime_env") or {}).get("env_vars") or {}
    return {"env_vars": {k: v for k, v in _WORKER_ENV.items() if k not in taken}}


def _ensure_ray(cfg: Config, world_size: int) -> None:
    import ray

    if ray.is_initialized():
        return
    env = _runtime_env()
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


# Ray Data's Parquet reader (datasource V2) starts RAY_DATA_PARQUET_FOOTER_NUM_ACTORS (32)
# footer-reading actors, a Python process each, every time a dataset is executed, i.e. once
# per replica leader. For a handful of files that is most of the data path's start-up on a
# small machine; scale them with the files (a user's own setting wins).
_FOOTER_ACTORS = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


def _data_env(cfg: Config) -> dict[str, str]:
    if cfg.data.path == "memory":
        return {}
    if _FOOTER_ACTORS in os.environ:
        return {_FOOTER_ACTORS: os.environ[_FOOTER_ACTORS]}
    import pyarrow.dataset as pads

    files = len(pads.dataset(cfg.data.path, format="parquet").files)
    return {_FOOTER_ACTORS: str(min(32, max(1, math.ceil(files / 64))))}


def _use_gpu(cfg: Config, world_size: int) -> bool:
    import ray

    if cfg.cluster.use_gpu is not None:
        return cfg.cluster.use_gpu
    return ray.cluster_resources().get("GPU", 0) >= world_size


def _datasets(cfg: Config) -> dict:
    if cfg.data.path == "memory":
        return {}
    datasets = {"train": build_dataset(cfg)}
    if cfg.data.val_path:
        datasets["val"] = build_rows_dataset(cfg, cfg.data.val_path)
    return {"datasets": datasets, "dataset_config": ReplicaDataConfig()}


def prepare_input(cfg: Config) -> Config:
    """Resolve data.path ("builtin" is prepared once) and check the files before workers start."""
    if cfg.data.text_columns and cfg.data.path in ("builtin", "memory"):  # a classifier: the shipped rows
        from raytrain_hybrid.rows import BUILTIN_TRAIN, BUILTIN_VAL

        path = cfg.data.path if cfg.data.path == "memory" else str(BUILTIN_TRAIN)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path))
        if not cfg.data.val_path:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_path=str(BUILTIN_VAL)))
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
    nodes = live_node_totals()
    counts = predict_workers_per_node(nodes, dims.world_size, resources, cfg.cluster.placement_strategy)
    if counts is not None:
        arrange_ranks(dims, [f"node{i}" for i, c in enumerate(counts) for _ in range(c)])
        _check_data_cpus(cfg, nodes, dims.world_size)
    return counts


def _check_data_cpus(cfg: Config, nodes: list[dict], world: int) -> None:
    """Ray Data's read tasks run outside the workers' placement group: a cluster whose CPUs the
    workers take entirely would start them and then wait for a CPU forever."""
    if cfg.data.path == "memory":
        return
    total = sum(n.get("CPU", 0) for n in nodes)
    taken = world * cfg.cluster.cpus_per_worker
    if total - taken < 1:
        raise ConfigError(
            "cluster.cpus_per_worker",
            cfg.cluster.cpus_per_worker,
            f"the cluster has {total:g} CPUs and {world} workers take {taken:g} of them, leaving none for "
            f"Ray Data's read tasks (the run would wait forever for one): give the cluster at least "
            f"{taken + 1:g} CPUs (e.g. `ray start --head --num-cpus={int(taken) + 1}`), lower "
            "cluster.cpus_per_worker, or use data.path=memory",
        )


def waiting_for() -> str:
    """What Ray is waiting for: pending placement groups and the resources free now."""
    import ray

    pending = [
        f"placement group of {len(pg['bundles'])} x {next(iter(pg['bundles'].values()), {})}"
        for pg in ray.util.placement_group_table().values()
        if pg.get("state") == "PENDING"
    ]
    free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    what = "; ".join(pending) if pending else "no pending placement group (the workers started: see their logs)"
    return f"Ray is waiting for: {what}. Cluster resources {total}, free now {free}"


# Start-up phases, each from the mark before it: where the time to the first step goes.
_PHASES = (
    ("ray_init", "ray_ready"),
    ("input_check", "input_checked"),
    ("worker_start", "worker_entered"),  # placement group, worker processes, process group
    ("worker_imports", "worker_imported"),
    ("process_group", "group_ready"),
    ("mesh", "mesh_built"),
    ("model_build", "model_built"),
    ("checkpoint_load", "checkpoint_loaded"),
    ("first_batch", "first_batch"),
    ("first_step", "first_step_done"),
)


def startup_breakdown(marks: dict) -> dict:
    """Seconds per start-up phase (rank 0's worker marks, the driver's own), and the total
    from the command to the end of the first step."""
    out, last = {}, marks.get("launched")
    for name, mark in _PHASES:
        if mark in marks and last is not None:
            out[name] = round(marks[mark] - last, 3)
            last = marks[mark]
    if "first_step_done" in marks:
        out["total_to_first_step"] = round(marks["first_step_done"] - marks["launched"], 3)
    return out


def summarize(cfg: Config, history: list[dict], memory: list[dict], restarts: int = 0) -> dict:
    par = cfg.parallelism
    # The first steps pay for warm-up (allocations, pipeline shape inference); leave them out.
    steady = history[min(2, len(history) - 1) :] if history else []
    summary = {
        "final_loss": history[-1]["loss"] if history else None,
        "steps": len(history),
        "restarts": restarts,
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
    evals = [{k: h[k] for k in h if k == "step" or k.startswith("val_")} for h in history if "val_accuracy" in h]
    if evals:  # classifiers: every evaluation, and the last one on its own
        summary["evals"] = evals
        summary["final_eval"] = evals[-1]
    return summary


def check_resume(cfg: Config, resume: str | None) -> tuple[str | None, list[dict]]:
    """Before anything starts: the checkpoint to resume is intact and fits this config, and no
    earlier run's checkpoints in run.output_dir would be overwritten. Returns the checkpoint
    directory and the metrics history to keep (the resumed run's, when it continues in place)."""
    out_dir = Path(cfg.run.output_dir).resolve()
    ckpt_root = out_dir / "checkpoints"
    existing = checkpoint.step_dirs(ckpt_root)
    if resume is None:
        if existing:
            raise ConfigError(
                "run.output_dir",
                str(out_dir),
                f"holds checkpoints of an earlier run ({existing[-1].name}); continue it with "
                f"--resume {out_dir}, or choose another run.output_dir",
            )
        (ckpt_root / "checkpoint_manager_snapshot.json").unlink(missing_ok=True)  # Ray's, of a run with none
        return None, []
    path, manifest = checkpoint.resolve(resume)
    checkpoint.check_compatible(cfg, manifest, path)
    later = [p for p in existing if int(p.name.split("_")[1]) > manifest["step"]]
    if later:
        raise ConfigError(
            "run.output_dir",
            str(out_dir),
            f"resuming {path.name} here would overwrite the later {later[-1].name}; "
            "resume into another run.output_dir (--set run.output_dir=...)",
        )
    history = []
    metrics = out_dir / "metrics.jsonl"
    if path.parent == ckpt_root and metrics.exists():  # continuing in place: keep the steps before
        history = [h for h in map(json.loads, metrics.read_text().splitlines()) if h["step"] < manifest["step"]]
    return str(path), history


def run(cfg: Config, resume: str | None = None, stream=None) -> dict:
    """Train on Ray; write metrics.jsonl and summary.json to run.output_dir; return the summary.

    ``resume``: a checkpoint directory, or a run directory meaning its newest checkpoint.
    ``stream``: where progress goes (default sys.stdout).
    """
    import uuid

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Empty, Queue

    marks = {"launched": time.time()}
    par = cfg.parallelism
    world = par.world_size
    out_dir = Path(cfg.run.output_dir).resolve()
    # Workers run elsewhere (another cwd, another node): they get the absolute path.
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=str(out_dir)))
    resume, kept_history = check_resume(cfg, resume)
    out_dir.mkdir(parents=True, exist_ok=True)
    _ensure_ray(cfg, world)
    marks["ray_ready"] = time.time()
    use_gpu = _use_gpu(cfg, world)
    resources = worker_resources(cfg, use_gpu)
    check_placement(cfg, resources)
    cfg = prepare_input(cfg)
    marks["input_checked"] = time.time()
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")
    data_env = _data_env(cfg)
    saved_env = {k: os.environ.get(k) for k in data_env}
    os.environ.update(data_env)  # also where the dataset is built, here on the driver
    try:
        datasets = _datasets(cfg)
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    sink = Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": cfg.to_dict(),
            "sink": sink,
            "use_gpu": use_gpu,
            "resume": resume,
            "launch_id": uuid.uuid4().hex,
            "data_env": data_env,
        },
        torch_config=TorchConfig(backend=backend),
        **datasets,
        scaling_config=ScalingConfig(
            num_workers=world,
            use_gpu=use_gpu,
            resources_per_worker=resources,
            placement_strategy=cfg.cluster.placement_strategy,
            accelerator_type=cfg.cluster.accelerator_type or None,
        ),
        run_config=RunConfig(
            # Ray Train's run directory is run.output_dir/checkpoints: checkpoints are written
            # there in place and registered with Ray (restarts, retention).
            name="checkpoints",
            storage_path=str(out_dir),
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep or None),
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised on the driver's main thread
            outcome["error"] = exc

    progress = RunLog(out_dir, steps=cfg.train.steps, progress=cfg.run.progress, history=kept_history, stream=stream)
    thread = threading.Thread(target=fit, daemon=True)
    marks["fit_called"] = time.time()
    thread.start()
    limit = cfg.run.startup_timeout_s
    try:
        while thread.is_alive() or not sink.empty():
            if limit and not progress.live_steps and time.time() - marks["fit_called"] > limit:
                # Leave the trainer thread: the driver exits, and Ray ends its workers with it.
                raise StartupTimeout(f"no training step after {limit:g} s (run.startup_timeout_s). {waiting_for()}")
            try:
                kind, payload = sink.get(timeout=0.5)
            except Empty:
                continue
            progress.handle(kind, payload)
        thread.join()
    finally:
        progress.close()
    if "error" in outcome:
        raise outcome["error"]
    summary = summarize(cfg, progress.history, progress.memory, progress.restarts)
    summary["startup_s"] = startup_breakdown({**marks, **progress.marks})
    summary["checkpoints"] = progress.checkpoints
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    ray.kill(sink.actor)
    return summary
