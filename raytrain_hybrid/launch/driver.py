"""Config -> Ray Train TorchTrainer: the driver's side of one run.

Per-step metrics reach the driver through a Ray queue that rank 0 feeds
(``Result.metrics`` keeps only the latest checkpoint's metrics), so the driver
can draw a progress bar and write ``metrics.jsonl`` while the run goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from raytrain_hybrid.checkpoint.manifest import check_compatible, resolve, step_dirs, step_number, verify
from raytrain_hybrid.checkpoint.trajectory import check_allowed, check_trajectory, data_restarts, describe
from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.autolayout import choose_layout, use_gpu_for
from raytrain_hybrid.launch.autoscale import POLL_S, ScalerProbe, StartupTimeout, StartupWatchdog
from raytrain_hybrid.launch.elastic import make_torch_trainer, scaling_workers, start_line, worker_counts
from raytrain_hybrid.launch.entry import train_loop_per_worker
from raytrain_hybrid.launch.inputs import build_datasets, prepare_input, reader_env, steps_to_train
from raytrain_hybrid.launch.lease import acquire
from raytrain_hybrid.launch.placement import worker_resources
from raytrain_hybrid.launch.preflight import check_placement, waiting_for
from raytrain_hybrid.launch.progress import RunLog
from raytrain_hybrid.launch.reach import cluster_reach
from raytrain_hybrid.launch.rundir import RunDir
from raytrain_hybrid.launch.session import ensure_ray, ray_address, resolve_use_gpu, use_train_v2
from raytrain_hybrid.launch.summary import startup_breakdown, startup_cpu, summarize
from raytrain_hybrid.launch.tracking import TrackedRun, check_tracking
from raytrain_hybrid.planner.hardware import Hardware
from raytrain_hybrid.storage import open_store


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint (None: from scratch), the metrics history to keep,
    the run's trajectory record (checkpoint.trajectory) and the step its data began at."""

    path: str | None
    history: list[dict]
    trajectory: dict
    data_origin: int = 0


def check_resume(cfg: Config, resume: str | None, allow_change: list[str] | None = None, say=print) -> ResumePoint:
    """Before anything starts: the checkpoint to resume is intact, fits this config and continues
    its trajectory (or the change is allowed: ``allow_change``), and no earlier run's checkpoints
    in run.output_dir would be overwritten. The history kept is the resumed run's, when it
    continues in place."""
    out = open_store(cfg.run.output_dir)
    ckpt_root = out.child("checkpoints")
    existing = step_dirs(ckpt_root)
    if resume is None:
        if existing:
            raise ConfigError(
                "run.output_dir",
                out.uri,
                f"holds checkpoints of an earlier run ({existing[-1].name}); continue it with "
                f"--resume {out.uri}, or choose another run.output_dir",
            )
        ckpt_root.child("checkpoint_manager_snapshot.json").delete()  # Ray's, of a run with none
        return ResumePoint(None, [], describe(cfg))
    allowed = check_allowed(allow_change or [])
    path, manifest = resolve(resume)
    if manifest["verified"] != "sha256":
        size = sum(f["size"] for f in manifest["files"].values()) / 2**30
        say(f"resume: {path} holds {size:,.0f} GiB: its files' sizes and metadata are checked, not their SHA-256")
    check_compatible(cfg, manifest, path)
    changed = check_trajectory(cfg, manifest, path, allowed)
    origin = manifest.get("data_origin", 0)
    for key in changed:
        say(f"resume: {key} differs from the checkpoint's (allowed by --allow-change)")
    if data_restarts(changed):
        origin = manifest["step"]
        say(f"resume: the data starts from its beginning at step {origin + 1}")
    # Only complete ones: on object storage a save cut short (a lost node, a killed job) leaves
    # step_<N>/ without its manifest, which the next save of step N replaces.
    if existing and path.parent.uri != ckpt_root.uri:
        raise ConfigError(
            "run.output_dir",
            out.uri,
            f"holds checkpoints of another run ({existing[-1].name}); resuming {path} there would mix and prune "
            "them: resume into an empty run.output_dir (--set run.output_dir=...), or continue that run with "
            f"--resume {out.uri}",
        )
    later = [p for p in existing if step_number(p) > manifest["step"] and _intact(p)]
    if later:
        raise ConfigError(
            "run.output_dir",
            out.uri,
            f"resuming {path.name} here would overwrite the later {later[-1].name}; "
            "resume into another run.output_dir (--set run.output_dir=...)",
        )
    history = []
    metrics = out.child("metrics.jsonl")
    if path.parent.uri == ckpt_root.uri and metrics.exists():  # continuing in place: keep the steps before
        history = [h for h in map(json.loads, metrics.read_text().splitlines()) if h["step"] < manifest["step"]]
    return ResumePoint(path.uri, history, describe(cfg), origin)


def _intact(path) -> bool:
    """A complete checkpoint by its sizes and metadata (a broken one is not "later" than a resume)."""
    try:
        verify(path, digests=False)
    except ConfigError:
        return False
    return True


def run(
    cfg: Config,
    resume: str | None = None,
    stream=None,
    driver_log: Path | None = None,
    allow_change: list[str] | None = None,
) -> dict:
    """Train on Ray; write metrics.jsonl and summary.json to run.output_dir; return the summary.

    ``resume``: a checkpoint directory, or a run directory meaning its newest checkpoint.
    ``stream``: where progress goes (default sys.stdout).
    ``driver_log``: the driver's log as it is written (the CLI's), kept as driver.log at every
    checkpoint and at the end.
    ``allow_change``: trajectory keys a resume may change on purpose (checkpoint.trajectory).
    """
    marks = {"launched": time.time()}
    check_tracking(cfg)  # run.tracking's package, before Ray starts
    use_train_v2()  # refused before Ray starts when a user turned Ray Train V2 off
    said: list[str] = []  # what is printed before the run (RunLog does not repeat it)

    def say(line: str) -> None:
        said.append(line)
        print(line, file=stream or sys.stdout, flush=True)

    cfg, point = prepare_run_dir(cfg, resume, allow_change, say)
    out = open_store(cfg.run.output_dir)
    fresh = not out.exists()
    lease = acquire(out.uri)  # one run per output directory, from here to the end (launch.lease)
    try:
        lease.start_renewing()
        return _run_leased(cfg, point, marks, say, said, stream, driver_log)
    finally:
        lease.release()
        if fresh and out.local:  # a run refused after the lease leaves no empty directory behind
            with contextlib.suppress(OSError):
                os.rmdir(out.path)


def _run_leased(cfg: Config, point: ResumePoint, marks: dict, say, said: list[str], stream, driver_log) -> dict:
    """The run, once its checks passed and it holds run.output_dir's lease."""
    import ray
    from ray.util.queue import Queue

    resume, kept_history = point.path, point.history
    cfg, use_gpu, resources, layout_hw = open_session(cfg, marks, say)
    open_store(cfg.run.output_dir).makedirs()  # only now: a refused run leaves nothing behind
    cfg = prepare_input(cfg, say=say)
    end = steps_to_train(cfg)
    if end < cfg.train.steps:
        say(
            f"data.epochs={cfg.data.epochs}: the rows hold {end} global batches of {cfg.train.global_batch_size}; "
            f"the run ends after step {end} (the LR schedule is train.steps={cfg.train.steps}'s)"
        )
    if is_elastic(cfg.parallelism):
        say(start_line(cfg))
    marks["input_checked"] = time.time()
    sink = Queue(actor_options=sink_options())  # rank 0's events, see the module docstring
    tracked = TrackedRun()  # run.tracking: its run is opened before any worker starts
    tracking = tracked.open(cfg)
    trainer = make_trainer(
        cfg,
        sink=sink,
        use_gpu=use_gpu,
        resources=resources,
        resume=resume,
        tracking=tracking,
        layout_hw=layout_hw,
        end=end,
        point=point,
    )
    run_dir = RunDir.open(cfg.run.output_dir, fresh=True)
    # config.json from the start: it reaches the output URI with the first checkpoint.
    (run_dir.local / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    run_log = RunLog(
        run_dir.local,
        steps=end,
        progress=cfg.run.progress,
        history=kept_history,
        stream=stream,
        on_checkpoint=functools.partial(run_dir.sync, driver_log),
        said=said,
    )
    with contextlib.closing(run_log), tracked:  # a run that fails ends its tracker run FAILED
        watchdog = StartupWatchdog.for_run(cfg.cluster, resources, cfg.run.startup_timeout_s)
        watch(trainer, sink, run_log, watchdog, marks)
    summary = write_results(cfg, run_log, marks, run_dir, driver_log)
    tracked.finish(summary)
    ray.kill(sink.actor)
    return summary


def sink_options() -> dict:
    """The event queue lives on the driver's node: a worker node may go away mid-run (the
    worker group restarts elsewhere), and the queue, with the events in it, must outlive it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    # Not soft: a soft affinity was seen to put it on a worker node now and then (0 CPUs fit anywhere).
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}


def prepare_run_dir(
    cfg: Config, resume: str | None, allow_change: list[str] | None = None, say=print
) -> tuple[Config, ResumePoint]:
    """run.output_dir as workers on any node reach it (a local path made absolute, a URI as
    it is), and the resume checked (see check_resume)."""
    out = open_store(cfg.run.output_dir)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=out.uri))
    return cfg, check_resume(cfg, resume, allow_change, say)


def open_session(cfg: Config, marks: dict, say=print) -> tuple[Config, bool, dict[str, float], Hardware | None]:
    """Join or start Ray, pick the layout (parallelism.layout="auto") and check the live cluster can
    place the workers: (the config at its layout, use_gpu, resources per worker, the profile an
    elastic layout=auto run's workers pick on)."""
    world = cfg.parallelism.world_size
    ensure_ray(cfg, world)
    marks["ray_ready"] = time.time()
    # The live nodes and those an autoscaler may add; the planner's pick for them, said with its runner-up.
    reach = cluster_reach(bool(ray_address(cfg)), cfg.cluster.accelerator_type)
    cfg, layout_hw = choose_layout(cfg, say, reach, use_gpu_for(cfg, reach.nodes))
    use_gpu = resolve_use_gpu(cfg, worker_counts(cfg)[0], reach.nodes)  # an elastic run starts on fewer
    resources = worker_resources(cfg, use_gpu)
    check_placement(cfg, resources)
    return cfg, use_gpu, resources, layout_hw


def make_trainer(
    cfg: Config,
    *,
    sink,
    use_gpu: bool,
    resources: dict[str, float],
    resume: str | None,
    tracking=None,
    layout_hw: Hardware | None = None,
    end: int | None = None,
    point: ResumePoint | None = None,
):
    """The run's TorchTrainer, with its Ray Datasets (unless data.path is "memory")."""
    use_train_v2()  # before the driver first imports ray.train (below, and data.ray_data in build_datasets)
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    data_env = reader_env(cfg)
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")
    return make_torch_trainer(
        cfg,
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config={
            "config": cfg.to_dict(),
            "sink": sink,
            "use_gpu": use_gpu,
            "resume": resume,
            "launch_id": uuid.uuid4().hex,
            "end": end,  # the steps the run trains (launch.inputs.steps_to_train)
            # The trajectory every manifest records, and the step this run's data began at.
            "trajectory": point.trajectory if point else None,
            "data_origin": point.data_origin if point else None,
            "data_env": data_env,
            "tracking": tracking,  # rank 0's tracker run (launch.tracking.TrackerRun), or None
            # An elastic run with layout=auto: the profile each start's pick is priced on.
            "layout_hardware": dataclasses.asdict(layout_hw) if layout_hw and is_elastic(cfg.parallelism) else None,
        },
        torch_config=TorchConfig(backend=backend),
        **build_datasets(cfg, data_env),
        scaling_config=ScalingConfig(
            **scaling_workers(cfg),  # a range of whole replicas for an elastic run (launch.elastic)
            use_gpu=use_gpu,
            resources_per_worker=resources,
            placement_strategy=cfg.cluster.placement_strategy,
            accelerator_type=cfg.cluster.accelerator_type or None,
        ),
        run_config=RunConfig(
            # Ray Train's run directory is run.output_dir/checkpoints: checkpoints are written
            # there in place and registered with Ray (restarts, retention).
            name="checkpoints",
            storage_path=cfg.run.output_dir,
            # A node drained for preemption (a spot reclaim) restarts the group too, counted apart
            # from run.max_failures and without limit (Ray Train's default, said here).
            failure_config=FailureConfig(max_failures=cfg.run.max_failures, max_preemption_failures=-1),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep or None),
        ),
    )


def watch(trainer, sink, run_log: RunLog, watchdog: StartupWatchdog, marks: dict) -> None:
    """Run ``trainer.fit()`` in a thread and hand the workers' events to ``run_log`` until it
    ends; its error is raised here, on the driver's main thread. Until the first step,
    ``watchdog`` reads the autoscaler every POLL_S and may end the run (see launch/autoscale.py)."""
    from ray.util.queue import Empty

    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    marks["fit_called"] = time.time()
    watchdog.start(marks["fit_called"])
    probe, next_look = ScalerProbe(since=marks["fit_called"]), 0.0
    thread.start()
    while thread.is_alive() or not sink.empty():
        if not run_log.live_steps and time.time() >= next_look:
            # Raising leaves the trainer thread: the driver exits, and Ray ends its workers with it.
            ran_out = watchdog.check(probe.read(), time.time())
            for line in watchdog.news:
                run_log._say(line)
            watchdog.news.clear()
            if ran_out:
                raise StartupTimeout(f"{ran_out}. {waiting_for()}")
            next_look = time.time() + POLL_S
        try:
            kind, payload = sink.get(timeout=0.5)
        except Empty:
            continue
        run_log.handle(kind, payload)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]


def write_results(cfg: Config, run_log: RunLog, marks: dict, run_dir: RunDir, driver_log: Path | None = None) -> dict:
    """summary.json in run.output_dir (config.json is there from the start); returns the summary."""
    summary = summarize(cfg, run_log.history, run_log.memory, run_log.restarts, run_log.restarted_from)
    summary["startup_s"] = startup_breakdown({**marks, **run_log.marks})
    summary["startup_cpu_s"] = startup_cpu(run_log.marks)  # rank 0's worker process
    summary["checkpoints"] = run_log.checkpoints
    summary["preemptions"] = run_log.preemptions  # notices and the saves made for them
    if is_elastic(cfg.parallelism):  # each start of the worker group: its step and dp
        summary["elastic"] = {
            "min_dp": cfg.parallelism.min_dp,
            "max_dp": cfg.parallelism.dp,
            "starts": run_log.dp_starts,
        }
    (run_dir.local / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    run_dir.sync(driver_log)
    return summary
