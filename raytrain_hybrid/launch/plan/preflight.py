"""Checks against the live cluster before any worker starts, and what Ray waits for after."""

from __future__ import annotations

import os

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import at_world
from raytrain_hybrid.distributed.parallel_dims import ParallelDims, check_nodes
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.plan.elastic import worker_counts
from raytrain_hybrid.launch.plan.placement import live_node_totals, predict_workers_per_node
from raytrain_hybrid.models import get_arch, hf_checkpoint
from raytrain_hybrid.storage import open_store


def check_placement(
    cfg: Config, resources: dict[str, float], nodes: list[dict] | None = None, counts: list[int] | None = None
) -> list[int] | None:
    """Refuse, before any worker starts, a layout the live nodes cannot hold with TP inside a node.

    Returns the predicted workers per node (None when the cluster cannot hold the group
    yet, e.g. while an autoscaler adds nodes; the workers then check what they got).
    """
    nodes = live_node_totals() if nodes is None else nodes  # the start plan's reach.live
    world, counts = predict_start(cfg, resources, nodes, counts)
    if cfg.fault_tolerance.enabled:  # the workers are one replica group: its layout
        from raytrain_hybrid.engine.replicas import group_config

        cfg = group_config(cfg)
    dims = ParallelDims.from_config(at_world(cfg, world).parallelism)
    _check_output_dir(cfg, nodes, resources)
    if counts is not None:
        check_nodes(dims, counts)  # (each node's workers consecutive: Ray Train's order)
        _check_data_cpus(cfg, nodes, dims.world_size)
    return counts


def check_weights(cfg: Config) -> None:
    """model.pretrained holds safetensors weights (resolving the config read its config.json only)."""
    if hf_checkpoint.is_set(cfg.model.pretrained) and get_arch(cfg.model.arch).from_hf is not None:
        hf_checkpoint.check_weights(cfg.model.pretrained, cfg.model.pretrained_revision)


# A private local Ray with more workers than this many per core: said before it starts.
CROWDED_PER_CORE = 4


def crowded(cfg: Config) -> str:
    """A warning when a run without a cluster gives this machine far more workers than cores
    (each takes seconds of CPU to start, and every step shares the cores); "" otherwise."""
    from raytrain_hybrid.launch.plan.address import ray_address

    if ray_address(cfg) or cfg.parallelism.layout == "auto":
        return ""
    world, cores = max(worker_counts(cfg)), os.cpu_count() or 1
    if world <= CROWDED_PER_CORE * cores:
        return ""
    return (
        f"warning: {world} workers on this machine's {cores} CPU cores: each takes seconds of CPU to start and "
        "every step shares the cores, so the first step may be minutes away; lower parallelism.dp, tp or pp "
        "(e.g. --set parallelism.dp=1), or train on a cluster (--address)"
    )


def predict_start(
    cfg: Config, resources: dict[str, float], nodes: list[dict], counts: list[int] | None = None
) -> tuple[int, list[int] | None]:
    """The workers a start has on ``nodes`` and how many each node gets (None: the nodes cannot hold
    it yet). An elastic run starts with the most workers of a usable layout the nodes hold now."""
    for world in reversed(counts or worker_counts(cfg)):
        placed = predict_workers_per_node(nodes, world, resources, cfg.cluster.placement_strategy)
        if placed is not None:
            break
    return world, placed


def _check_output_dir(cfg: Config, nodes: list[dict], resources: dict[str, float]) -> None:
    """A local run.output_dir works only where every worker sees the driver's disk: one node.
    Elsewhere each node would keep its own shards and a restart, --resume or export on another
    node would find nothing. A single node that cannot hold even one worker (an autoscaler's
    CPU-only head) means the workers will run on nodes still to come."""
    out = open_store(cfg.run.output_dir)
    if not out.local or cfg.run.shared_fs:
        return
    hosts_a_worker = any(all(n.get(k, 0) >= v for k, v in resources.items()) for n in nodes)
    if len(nodes) <= 1 and hosts_a_worker:
        return
    where = f"the cluster has {len(nodes)} nodes" if len(nodes) > 1 else "the workers will run on nodes still to come"
    raise ConfigError(
        "run.output_dir",
        cfg.run.output_dir,
        f"is a directory on this node's disk and {where}, each with its own disk; use storage every node "
        "reaches: an object-store URI (e.g. s3://bucket/run, gs://bucket/run), or a filesystem mounted on "
        "every node with run.shared_fs=true",
    )


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
