"""Elastic data parallelism on Ray Train V2 (parallelism.min_dp): what the driver asks of Ray.

``ScalingConfig(num_workers=(min, max))`` selects Ray Train's elastic policy: it starts the
worker group with as many workers as the cluster holds in that range, and while the group
runs it looks again every ``elastic_resize_monitor_interval_s``; a change tears the group
down and starts the train function again on the new count, from the newest checkpoint.
Ray's policy counts single workers, so it could start 5 workers of a layout whose replicas
are 2 ranks each, or 3 replicas of a global batch that 3 does not split into whole
micro-batches. Ours (launch.runtime.elastic_ray) asks it only for the counts of usable layouts:
whole replicas of cp*tp*pp workers, every TP group on one node, at a dp of config.elastic's
``usable_dps``. The workers then take dp = world // (cp*tp*pp) (config.elastic.at_world):
context parallelism keeps its cp at every start, as tp and pp are kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic, usable_dps

# Seconds between Ray Train's looks for a larger cluster while the group runs (a grow
# restarts the group, so not too often); unset: Ray's default, 60.
RESIZE_CHECK_ENV = "RAYTRAIN_HYBRID_RESIZE_CHECK_S"


def worker_counts(cfg: Config) -> list[int]:
    """The worker counts a start may have, ascending (one for a fixed run)."""
    par = cfg.parallelism
    if cfg.fault_tolerance.enabled:  # a launch is one replica group (config.fault_tolerance)
        from raytrain_hybrid.config.fault_tolerance import replica_groups

        return [par.world_size // replica_groups(par)]
    return [dp * par.cp * par.tp * par.pp for dp in usable_dps(par)]  # a replica: cp*tp*pp workers


def scaling_workers(cfg: Config, counts: list[int] | None = None) -> dict:
    """ScalingConfig's num_workers (a range for an elastic run) and its resize interval.
    ``counts``: the run plan's worker counts (default: worked out from ``cfg``)."""
    counts = counts or worker_counts(cfg)
    if not is_elastic(cfg.parallelism):
        return {"num_workers": counts[-1]}
    out: dict = {"num_workers": (counts[0], counts[-1])}
    if os.environ.get(RESIZE_CHECK_ENV):
        out["elastic_resize_monitor_interval_s"] = float(os.environ[RESIZE_CHECK_ENV])
    return out


def workers_that_fit(
    nodes: Iterable[dict[str, float]], per_worker: dict[str, float], tp: int, counts: list[int]
) -> int:
    """The largest of ``counts`` whose workers the nodes hold with every TP group inside one node
    (a node's room rounded down to whole TP groups). When not even the smallest fits, the room
    itself, which is below every count (Ray's policy then waits)."""
    needs = {k: v for k, v in per_worker.items() if v > 0}
    if not needs:
        return counts[-1]
    room = 0
    for resources in nodes:
        n = min(int(resources.get(k, 0) // v) for k, v in needs.items())
        room += n - n % tp
    fitting = [c for c in counts if c <= room]
    return fitting[-1] if fitting else room


def start_line(cfg: Config) -> str:
    """What the driver says before an elastic run starts."""
    par = cfg.parallelism
    every = os.environ.get(RESIZE_CHECK_ENV) or "60"
    return (
        f"elastic: dp between {par.min_dp} and {par.dp}, at one of {usable_dps(par)} "
        f"({par.cp * par.tp * par.pp} workers a replica); a lost node restarts the group from the newest "
        "checkpoint at the dp the nodes left hold, "
        f"and Ray Train looks for more nodes every {every} s"
    )
