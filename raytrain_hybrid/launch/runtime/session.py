"""Joining or starting the Ray cluster a run uses, and what its workers run with."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading

from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError, LayoutError
from raytrain_hybrid.launch.plan.address import ray_address

_TRAIN_V2 = "RAY_TRAIN_V2_ENABLED"


def use_train_v2() -> None:
    """Ray Train V2, on which the launcher is built: the default of Ray 2.60, so nothing is set
    (Ray Train hands a variable set on the driver to every worker as a runtime env, and a worker
    with a runtime env starts through a second Python process: ~0.5 s of CPU each). A user who
    turned it off is told, before ray.train is imported."""
    if os.environ.get(_TRAIN_V2, "1").strip().lower() in ("0", "false", "no", "off"):
        raise ConfigError(
            _TRAIN_V2,
            os.environ[_TRAIN_V2],
            "selects Ray Train V1; raytrain_hybrid runs on Ray Train V2 (Ray's "
            "default): unset the variable or set it to 1",
        )


def ensure_ray(cfg: Config, world_size: int) -> None:
    """Join the cluster ray_address(cfg) names, else start a private local Ray with enough logical
    CPUs for every worker (plus one for Ray Train's controller), however few cores the machine has."""
    join_ray(ray_address(cfg), need_cpus=local_cpus(cfg, world_size))


def local_cpus(cfg: Config, world_size: int) -> int:
    """The logical CPUs of the private local Ray a run starts without a cluster: one for every
    worker's cluster.cpus_per_worker, one for Ray Train's controller, at least the machine's cores."""
    return max(math.ceil(world_size * cfg.cluster.cpus_per_worker) + 1, os.cpu_count() or 1)


def join_ray(address: str, need_cpus: int = 0) -> None:
    """ray.init on ``address`` (from launch.plan.address.join_address), or a private local Ray when it is ""."""
    import ray

    if ray.is_initialized():
        return
    with _sigterm_kept():
        # No runtime env of ours: the workers need no variable of this package's (a runtime env
        # would also start each worker process twice, see use_train_v2).
        if address:
            ray.init(address=address, log_to_driver=False)
            return
        _start_local_ray(max(need_cpus, os.cpu_count() or 1))
    # Its processes end with this one however it ends, kill -9 included (launch.runtime.reaper).
    from raytrain_hybrid.launch.runtime import reaper

    reaper.start()


# Ray gives its raylet 30 s to come up; on a busy machine it may miss that once.
_RAY_START_TRIES = 2


def _start_local_ray(num_cpus: int) -> None:
    """A private local Ray. A start that timed out is cleaned up (what it left running: its GCS,
    monitors, dashboard agent) and tried again once; a second failure is said in one line."""
    import psutil
    import ray

    for attempt in range(1, _RAY_START_TRIES + 1):
        before = {p.pid for p in psutil.Process().children()}
        try:
            ray.init(address="local", num_cpus=num_cpus, log_to_driver=False, include_dashboard=False)
            return
        except Exception as exc:
            ray.shutdown()
            for proc in left_by_a_failed_start(before):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            if "timed out during startup" not in str(exc):
                raise
            if attempt == _RAY_START_TRIES:
                raise RayStartError(
                    f"the local Ray did not start ({_RAY_START_TRIES} tries; Ray: {str(exc).splitlines()[0]}): "
                    "the machine may be too busy; try again, or pass --address to join a running cluster"
                ) from exc


def left_by_a_failed_start(before: set[int]) -> list:
    """What a failed ``ray.init`` left running: this process's Ray children born since ``before``
    (its GCS, raylet, dashboard, monitors: ray.init starts them as direct children) and theirs.
    Nothing else of this process is touched: another thread's processes, or their children born
    meanwhile, are not the start's (in a test process, a cluster that other tests run)."""
    import psutil

    left = []
    for child in psutil.Process().children():
        try:
            if child.pid not in before and "ray" in " ".join(child.cmdline()):
                left += [child, *child.children(recursive=True)]
        except psutil.Error:
            continue
    return left


class RayStartError(RuntimeError):
    """The private local Ray a command needs did not come up."""


@contextlib.contextmanager
def _sigterm_kept():
    """ray.init replaces this process's SIGTERM handler with its own (which exits at once, and
    kills the local Ray it started): a handler set before it (the CLI's, which ends a run with its
    records written and each replica group told) is put back."""
    main = threading.current_thread() is threading.main_thread()
    held = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    except SystemExit as exc:  # ray.init's handler ran (SIGTERM while Ray starts): ended as the CLI's ends it
        if callable(held) and exc.code == signal.SIGTERM:
            held(signal.SIGTERM, None)
        raise
    finally:
        if callable(held):
            signal.signal(signal.SIGTERM, held)


def live_workers_per_node(cfg: Config, world: int, say=print) -> list[int]:
    """Workers per node that a placement on the cluster ray_address(cfg) names would give, with the
    nodes its autoscaler may add (joined here); one node holding all without a cluster."""
    address = ray_address(cfg)
    if not address:
        return [world]
    from raytrain_hybrid.launch.plan.placement import predict_workers_per_node, worker_resources
    from raytrain_hybrid.launch.plan.reach import cluster_reach

    join_ray(address)
    reach = cluster_reach(True, cfg.cluster.accelerator_type)
    per_worker = worker_resources(cfg, resolve_use_gpu(cfg, world, reach.nodes))
    counts = predict_workers_per_node(reach.nodes, world, per_worker, cfg.cluster.placement_strategy)
    if counts is None:
        more = " with the nodes its autoscaler may add" if reach.added else " now"
        raise LayoutError(
            f"the cluster at {address} cannot hold {world} workers of {per_worker}{more}; "
            "pass --topology to check a placement you expect (e.g. 8,8)"
        )
    for line in reach.said():
        say(f"placement: {line}")
    return counts


def resolve_use_gpu(cfg: Config, world_size: int, nodes: list[dict[str, float]]) -> bool:
    """cluster.use_gpu, or when unset, whether ``nodes`` (those the cluster may reach: an autoscaler's
    GPU nodes may not be up yet) have a GPU for every worker."""
    if cfg.cluster.use_gpu is not None:
        return cfg.cluster.use_gpu
    return sum(n.get("GPU", 0) for n in nodes) >= world_size
