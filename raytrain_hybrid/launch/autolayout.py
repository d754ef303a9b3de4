"""parallelism.layout = "auto" on a cluster: the workers each node holds now, handed to the
planner (planner.auto), before any worker starts; `train` and `check` print its pick."""

from __future__ import annotations

from collections.abc import Callable

from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.placement import live_node_totals, predict_workers_per_node, worker_resources
from raytrain_hybrid.planner.auto import hardware_for, pick


def node_slots(cfg: Config, nodes: list[dict[str, float]], use_gpu: bool) -> list[int]:
    """Workers each node holds (whole workers of cluster.cpus_per_worker CPUs, and a GPU each),
    most first. Ray Data's read tasks need a CPU the workers leave free somewhere in the cluster
    (launch.preflight): unless data.path is "memory", the largest node gives up workers until one is."""
    per_worker = worker_resources(cfg, use_gpu)
    slots = [min(int(n.get(k, 0) // v) for k, v in per_worker.items() if v > 0) for n in nodes]
    spare = sum(n.get("CPU", 0) for n in nodes) - sum(slots) * cfg.cluster.cpus_per_worker
    while cfg.data.path != "memory" and spare < 1 and any(slots):
        slots[slots.index(max(slots))] -= 1
        spare += cfg.cluster.cpus_per_worker
    return sorted((s for s in slots if s > 0), reverse=True)


def choose_layout(
    cfg: Config, say: Callable[[str], None], nodes: list[dict[str, float]] | None = None, use_gpu: bool | None = None
) -> Config:
    """``cfg`` at the planner's layout for ``nodes`` (default: the connected cluster's live nodes);
    ``cfg`` itself unless parallelism.layout is "auto". Refuses (ConfigError) when none fits."""
    if cfg.parallelism.layout != "auto":
        return cfg
    nodes = live_node_totals() if nodes is None else nodes
    use_gpu = _use_gpu(cfg, nodes) if use_gpu is None else use_gpu
    slots = node_slots(cfg, nodes, use_gpu)
    picked, lines = pick(cfg, slots, hardware_for(nodes, use_gpu, slots))
    for line in lines:
        say(line)
    return picked


def _use_gpu(cfg: Config, nodes: list[dict[str, float]]) -> bool:
    """cluster.use_gpu, or when unset, whether the nodes have GPUs."""
    return cfg.cluster.use_gpu if cfg.cluster.use_gpu is not None else any(n.get("GPU", 0) for n in nodes)


def pick_for_check(cfg: Config, held: list[int] | None, say: Callable[[str], None]) -> tuple[Config, list[int]]:
    """`check` with layout=auto: the pick for nodes holding ``held`` workers each (a GPU each
    unless cluster.use_gpu=false), or for the connected cluster's nodes (None); returns the
    config at the pick and the workers each node would get."""
    import ray

    if held is not None:
        gpu = cfg.cluster.use_gpu is not False
        cpus = cfg.cluster.cpus_per_worker
        nodes = [{"CPU": c * cpus, **({"GPU": c} if gpu else {})} for c in held] + [{"CPU": 1}]  # and a head's CPU
    elif ray.is_initialized():
        nodes, gpu = live_node_totals(), None
    else:
        raise ConfigError(
            "parallelism.layout",
            "auto",
            "check picks for a cluster: run it where RAY_ADDRESS (or cluster.address) names one, or pass "
            "--topology with the workers each node holds (e.g. 4,4)",
        )
    gpu = _use_gpu(cfg, nodes) if gpu is None else gpu
    cfg = choose_layout(cfg, say, nodes, gpu)
    holds = [{"W": float(s)} for s in node_slots(cfg, nodes, gpu)]
    counts = predict_workers_per_node(holds, cfg.parallelism.world_size, {"W": 1.0}, cfg.cluster.placement_strategy)
    return cfg, counts or []
