"""Config -> Ray Train TorchTrainer: the driver's side of one run.

Per-step metrics reach the driver through a Ray queue that rank 0 feeds
(``Result.metrics`` keeps only the latest checkpoint's metrics), so the driver
can draw a progress bar and write ``metrics.jsonl`` while the run goes on.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from raytrain_hybrid.checkpoint.manifest import MANIFEST, step_dirs, step_number
from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic
from raytrain_hybrid.errors import redact
from raytrain_hybrid.launch.plan.elastic import scaling_workers
from raytrain_hybrid.launch.plan.inputs import build_datasets
from raytrain_hybrid.launch.plan.preflight import waiting_for
from raytrain_hybrid.launch.records.lease import LeaseLost, acquire
from raytrain_hybrid.launch.records.progress import RunLog
from raytrain_hybrid.launch.records.rundir import RunDir, complete_records
from raytrain_hybrid.launch.records.summary import startup_breakdown, startup_cpu, summarize
from raytrain_hybrid.launch.records.tracking import TrackedRun, check_tracking
from raytrain_hybrid.launch.runtime.autoscale import POLL_S, ScalerProbe, StartupTimeout, StartupWatchdog
from raytrain_hybrid.launch.runtime.entry import train_loop_per_worker
from raytrain_hybrid.launch.runtime.session import use_train_v2
from raytrain_hybrid.launch.runtime.start import RunPlan, check_before_ray, plan_run, prepare_run_dir, start_run
from raytrain_hybrid.launch.runtime.waiting import Waiting
from raytrain_hybrid.storage import open_store
from raytrain_hybrid.storage.nofollow import write_new


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
    asked = cfg  # as loaded: the plan resolves the rest (launch.runtime.start.RunPlan)
    check_tracking(cfg)  # run.tracking's package, before Ray starts
    use_train_v2()  # refused before Ray starts when a user turned Ray Train V2 off
    said: list[str] = []  # what is printed before the run (RunLog does not repeat it)

    def say(line: str) -> None:
        line = redact(line)  # every line the driver prints (a path, a pyarrow error) is redacted
        said.append(line)
        print(line, file=stream or sys.stdout, flush=True)

    out = open_store(cfg.run.output_dir)
    fresh = not out.exists()
    # One run per output directory, from here to the end (launch.records.lease); taken before the resume
    # picks its checkpoint: a killed run's workers that outlive their driver complete no save
    # after this (checkpoint.save), so the checkpoint picked is the newest there will be.
    lease = acquire(out.uri)
    try:
        cfg, point = prepare_run_dir(cfg, resume, allow_change, say)
        if point.finished:  # nothing left to train: the run's records completed (said), no Ray
            return complete_records(cfg, point)
        lease.start_renewing()
        # The plan, derived before Ray starts as `check` derives it: a refusal comes in seconds.
        cfg, data = check_before_ray(cfg, say)
        plan = plan_run(cfg, point, say, data=data, asked=asked)
        marks["planned"] = time.time()
        return _run_leased(plan, marks, say, said, stream, driver_log, lease.held)
    finally:
        lease.release()
        if fresh and out.local:  # a run refused after the lease leaves no empty directory behind
            with contextlib.suppress(OSError):
                os.rmdir(out.path)


def _run_leased(plan: RunPlan, marks: dict, say, said: list[str], stream, driver_log, held=lambda: True) -> dict:
    """``plan`` run, once it holds run.output_dir's lease (``held``: whether it still does; a run
    that lost it to another run writes nothing more there): said, then Ray started for it."""
    import ray
    from ray.util.queue import Queue

    cfg = plan.cfg
    for line in plan.lines():
        say(line)
    try:
        start_run(plan, marks, say)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM while Ray starts (the longest wait): said there too
        with contextlib.suppress(Exception):
            if held():
                open_store(cfg.run.output_dir).makedirs()  # (start_run makes it once Ray is up)
                run_dir, run_log = _records(plan, stream, driver_log, said)
                with contextlib.closing(run_log):
                    write_results(cfg, run_log, marks, run_dir, driver_log, ended=how_ended(exc))
                exc.records_written = True  # (the CLI's line says where)
        raise
    sink = Queue(actor_options=sink_options())  # rank 0's events, see the module docstring
    tracked = TrackedRun()  # run.tracking: its run is opened before any worker starts
    tracking = tracked.open(cfg)
    trainer = make_trainer(plan, sink=sink, tracking=tracking)
    run_dir, run_log = _records(plan, stream, driver_log, said)
    try:
        with contextlib.closing(run_log), tracked:  # a run that fails ends its tracker run FAILED
            watchdog = StartupWatchdog.for_run(cfg.cluster, plan.resources, cfg.run.startup_timeout_s)
            # A run whose lease another run took over stops at once (launch.records.lease): no more saves there.
            watch(trainer, sink, run_log, watchdog, marks, lost=lambda: None if held() else lease_lost(cfg, held))
    except BaseException as exc:  # failed, Ctrl-C, SIGTERM (cli): summary.json says how, beside driver.log
        with contextlib.suppress(Exception):
            if held():  # (not over the summary of the run that took the directory over)
                write_results(cfg, run_log, marks, run_dir, driver_log, ended=how_ended(exc))
                exc.records_written = True
        raise
    if not held():
        raise lease_lost(cfg, held)
    pruned = prune_earlier(cfg)
    if pruned:
        say(
            f"checkpoint.keep={cfg.checkpoint.keep}: removed {', '.join(pruned)}, left by an earlier launch of this run"
        )
    summary = write_results(cfg, run_log, marks, run_dir, driver_log)
    tracked.finish(summary)
    ray.kill(sink.actor)
    return summary


def _records(plan: RunPlan, stream, driver_log, said: list[str]) -> tuple[RunDir, RunLog]:
    """The run's files from its start: config.json, and metrics.jsonl (the steps a resume keeps)."""
    run_dir = RunDir.open(plan.cfg.run.output_dir, fresh=True)
    write_config(plan.cfg, run_dir)
    run_log = RunLog(
        run_dir.local,
        steps=plan.end,
        progress=plan.cfg.run.progress,
        history=plan.point.history,
        stream=stream,
        on_checkpoint=functools.partial(run_dir.sync, driver_log),
        said=said,
    )
    return run_dir, run_log


def lease_lost(cfg: Config, held) -> LeaseLost:
    """The error of a run whose lease on run.output_dir another run took over (``held``: the
    lease's ``held``, whose ``lost`` names the run that has it)."""
    who = getattr(getattr(held, "__self__", None), "lost", "")
    return LeaseLost(
        f"run.output_dir={cfg.run.output_dir} was taken over by another run{f' ({who})' if who else ''} while "
        "this one ran: this run stopped and wrote nothing more there (no save completed after the takeover, no "
        "pruning, no summary.json)"
    )


# While a run goes on, how often the driver looks at its lease (a small read of run.lease.json).
LEASE_LOOK_S = 5.0


def prune_earlier(cfg: Config) -> list[str]:
    """checkpoint.keep over the whole run directory at the end of a run: Ray Train prunes the
    checkpoints it registered, not those an earlier launch left (a run killed, then resumed in
    place), nor saves cut short before its newest complete one. Those older than the newest
    ``keep`` complete checkpoints go; what Ray's own record lists stays Ray's to prune."""
    keep = cfg.checkpoint.keep
    root = open_store(cfg.run.output_dir).child("checkpoints")
    if not keep:
        return []
    snapshot = root.child("checkpoint_manager_snapshot.json")
    try:
        ray_known = {r["checkpoint_dir_name"] for r in json.loads(snapshot.read_text())["checkpoint_results"]}
    except (OSError, ValueError, KeyError, TypeError):
        return []  # no record of Ray's to go by: prune nothing rather than something Ray will
    dirs = step_dirs(root)
    complete = [p for p in dirs if p.child(MANIFEST).exists()]
    if not complete:
        return []
    kept = {p.name for p in complete[-keep:]}
    newest = step_number(complete[-1])
    gone = [p for p in dirs if p.name not in kept and p.name not in ray_known and step_number(p) < newest]
    for p in gone:
        p.delete()
    return [p.name for p in gone]


def sink_options() -> dict:
    """The event queue lives on the driver's node: a worker node may go away mid-run (the
    worker group restarts elsewhere), and the queue, with the events in it, must outlive it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    # Not soft: a soft affinity was seen to put it on a worker node now and then (0 CPUs fit anywhere).
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}


def make_trainer(plan: RunPlan, *, sink, tracking=None):
    """The run's TorchTrainer, with its Ray Datasets (unless data.path is "memory"), as planned."""
    use_train_v2()  # before the driver first imports ray.train (below, and data.ray_data in build_datasets)
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from raytrain_hybrid.launch.runtime.backend import torch_config  # imports ray.train: after use_train_v2

    cfg, use_gpu = plan.cfg, plan.use_gpu
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else ("nccl" if use_gpu else "gloo")
    return make_torch_trainer(
        plan,
        train_loop_per_worker=train_loop_per_worker,
        # The plan as every worker gets it (engine.plan.WorkerPlan, read-only), and the run's two
        # live handles: the driver's event queue and rank 0's tracker run (launch.records.tracking.TrackerRun).
        train_loop_config={"plan": plan.for_workers(), "sink": sink, "tracking": tracking},
        torch_config=torch_config(cfg, backend),  # with run.hang_timeout_s, NCCL's flight recorder
        **build_datasets(cfg, plan.data_env),
        scaling_config=ScalingConfig(
            **scaling_workers(cfg, plan.counts),  # a range of whole replicas for an elastic run (launch.plan.elastic)
            use_gpu=use_gpu,
            resources_per_worker=plan.resources,
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


def make_torch_trainer(plan: RunPlan, **kwargs):
    """TorchTrainer(**kwargs); for an elastic run the one whose policy starts only the plan's
    worker counts (launch.runtime.elastic_ray)."""
    from ray.train.torch import TorchTrainer

    if not is_elastic(plan.cfg.parallelism):
        return TorchTrainer(**kwargs)
    from raytrain_hybrid.launch.runtime.elastic_ray import ReplicaTorchTrainer

    return ReplicaTorchTrainer(counts=plan.counts, tp=plan.cfg.parallelism.tp, **kwargs)


def watch(trainer, sink, run_log: RunLog, watchdog: StartupWatchdog, marks: dict, lost=lambda: None) -> None:
    """Run ``trainer.fit()`` in a thread and hand the workers' events to ``run_log`` until it
    ends; its error is raised here, on the driver's main thread. Until the first step,
    ``watchdog`` reads the autoscaler every POLL_S and may end the run (see launch/runtime/autoscale.py),
    and a line every few seconds says what the run waits for (launch/runtime/waiting.py). Every
    LEASE_LOOK_S, ``lost()`` (an error, or None) says whether the run lost its lease: raised here,
    it ends the run at once."""
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
    next_lease_look = time.time() + LEASE_LOOK_S
    waiting = Waiting(since=marks.get("launched", marks["fit_called"]))
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
            if waiting.due():  # every few seconds until the first step: what the run waits for
                run_log._say(waiting.what(run_log.starts))
            next_look = time.time() + POLL_S
        if time.time() >= next_lease_look:
            if (error := lost()) is not None:  # raising leaves the trainer thread, as above
                raise error
            next_lease_look = time.time() + LEASE_LOOK_S
        try:
            event = sink.get(timeout=0.5)
        except Empty:
            continue
        run_log.handle(event)
    thread.join()
    if "error" in outcome:
        # A run whose lease another run took over fails in its workers too (their saves are
        # refused): the takeover is the cause, and is what the run ends saying.
        raise lost() or outcome["error"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised on the driver's main thread (the CLI's handler) so that the run ends as
    after Ctrl-C: Ray shut down, driver.log and summary.json written."""


@contextlib.contextmanager
def sigterm_ends_the_run():
    """SIGTERM (a job stopped, `kill`) ends a run as Ctrl-C does: its files written, one line said."""

    def terminate(signum, frame):
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def how_ended(exc: BaseException | None) -> str:
    """summary.json's "ended": completed, interrupted (Ctrl-C), terminated (SIGTERM), or failed: why."""
    if exc is None:
        return "completed"
    if isinstance(exc, KeyboardInterrupt):
        return "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"
    return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]


def write_config(cfg: Config, run_dir: RunDir) -> None:
    """config.json from the start: it reaches the output URI with the first checkpoint. A link
    planted at the name (a shared run directory) is replaced, its target left as it was."""
    write_new(run_dir.local / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")


def write_results(
    cfg: Config,
    run_log: RunLog,
    marks: dict,
    run_dir: RunDir,
    driver_log: Path | None = None,
    ended: str = "completed",
) -> dict:
    """summary.json in run.output_dir (config.json is there from the start); returns the summary.
    ``ended``: how the run ended (how_ended); one that did not complete has the steps it made."""
    summary = {"ended": ended}
    summary |= summarize(cfg, run_log.history, run_log.memory, run_log.restarts, run_log.restarted_from)
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
    write_new(run_dir.local / "summary.json", json.dumps(summary, indent=2) + "\n")
    run_dir.sync(driver_log)
    return summary
