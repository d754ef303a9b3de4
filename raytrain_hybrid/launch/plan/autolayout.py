"""parallelism.layout = "auto" on a cluster: the workers each node holds, the live nodes and
those an autoscaler may add (launch.plan.reach), handed to the planner (planner.auto) before any
worker starts; `train` and `check` print its pick.

An elastic run (parallelism.min_dp) with layout=auto asks Ray for whole replicas of the
configured tp*pp, as a fixed one does (launch.plan.elastic), and picks at every start of its worker
group, the first and each resize: the best layout that uses all the workers Ray started, on the
nodes they landed on (``group_layout``, in the workers). Every layout trains the same model and
checkpoints reshard, so a pick changes the speed, never the losses.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import at_world, is_elastic
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.plan.elastic import worker_counts, workers_that_fit
from raytrain_hybrid.launch.plan.placement import predict_workers_per_node, worker_resources
from raytrain_hybrid.launch.plan.reach import Reach, cluster_reach
from raytrain_hybrid.planner.auto import hardware_for, pick, pick_for_group
from raytrain_hybrid.planner.hardware import Hardware


def node_slots(cfg: Config, nodes: list[dict[str, float]], use_gpu: bool) -> list[int]:
    """Workers each node holds (whole workers of cluster.cpus_per_worker CPUs, and a GPU each),
    most first. Ray Data's read tasks need a CPU the workers leave free somewhere in the cluster
    (launch.plan.preflight): unless data.path is "memory", the largest node gives up workers until one is."""
    per_worker = worker_resources(cfg, use_gpu)
    slots = [min(int(n.get(k, 0) // v) for k, v in per_worker.items() if v > 0) for n in nodes]
    spare = sum(n.get("CPU", 0) for n in nodes) - sum(slots) * cfg.cluster.cpus_per_worker
    while cfg.data.path != "memory" and spare < 1 and any(slots):
        slots[slots.index(max(slots))] -= 1
        spare += cfg.cluster.cpus_per_worker
    return sorted((s for s in slots if s > 0), reverse=True)


def choose_layout(
    cfg: Config, say: Callable[[str], None], reach: Reach, use_gpu: bool
) -> tuple[Config, Hardware | None]:
    """``cfg`` at the planner's layout for the nodes the cluster may reach (``reach``: the live ones
    and those an autoscaler may add), and the profile it was priced on, which an elastic run's
    workers pick on at every start; ``cfg`` and None unless parallelism.layout is "auto". Refuses
    (ConfigError) when none fits."""
    if cfg.parallelism.layout != "auto":
        return cfg, None
    slots, hw = _priced_on(cfg, reach.nodes, use_gpu)
    if is_elastic(cfg.parallelism):  # each start picks for its own workers (group_layout)
        first = first_start(cfg, reach.live, use_gpu, hw)  # Ray starts on the nodes up when it asks
        lines = first[2] if first else [f"{_EACH_START}; the nodes hold none of {worker_counts(cfg)} yet"]
        for line in lines:
            say(line)
        return cfg, hw
    for line in reach.said():
        say(f"layout auto: {line}" + (": picking for the most the cluster may reach" if reach.added else ""))
    picked, lines = pick(cfg, slots, hw)
    for line in lines:
        say(line)
    if reach.added:  # what waiting for the autoscaler's nodes buys
        say(_live_alone(cfg, reach.live, use_gpu, hw))
    return picked, hw


def _priced_on(cfg: Config, nodes: list[dict[str, float]], use_gpu: bool) -> tuple[list[int], Hardware]:
    """The workers each of ``nodes`` holds, and the profile a pick for them is priced on."""
    slots = node_slots(cfg, nodes, use_gpu)
    return slots, hardware_for(nodes, use_gpu, slots)


def _live_alone(cfg: Config, live: list[dict[str, float]], use_gpu: bool, hw: Hardware) -> str:
    slots = node_slots(cfg, live, use_gpu)
    try:
        _, lines = pick(cfg, slots, dataclasses.replace(hw, gpus_per_node=max(slots, default=1)))
    except ConfigError:
        return f"layout auto: the live nodes alone hold no layout yet (workers a node: {slots})"
    return lines[0].replace("layout auto: ", "layout auto: the live nodes alone would take ", 1)


def layout_for_group(cfg: Config, node_ids: list[str], hw: Hardware) -> tuple[Config, list[str]]:
    """An elastic layout=auto run's start on workers of ``node_ids`` (one per rank): the config at
    the planner's best layout of all of them, and the lines that say why. When the planner fits
    none (its memory estimate), the configured replicas at the dp the workers make."""
    slots = sorted(Counter(node_ids).values(), reverse=True)
    got = pick_for_group(cfg, slots, hw)
    if got is not None:
        return got
    fixed = at_world(cfg, len(node_ids))
    par = fixed.parallelism
    return fixed, [
        f"layout auto: no layout of the {len(node_ids)} workers on nodes holding {slots} fits by the planner's "
        f"estimate ({hw.name}); the configured replicas: dp={par.dp} tp={par.tp} pp={par.pp} "
        f"microbatches={par.microbatches}"
    ]


def group_layout(cfg: Config, node_id: str, hw: Hardware) -> tuple[Config, list[str]]:
    """``layout_for_group`` for this worker group (every rank calls it; ``node_id`` this rank's
    node): rank 0 picks, every rank takes its pick, so all build one mesh."""
    import torch.distributed as dist

    node_ids: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(node_ids, node_id)
    box = [layout_for_group(cfg, node_ids, hw) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_start(
    cfg: Config, nodes: list[dict], use_gpu: bool, hw: Hardware
) -> tuple[Config, list[int], list[str]] | None:
    """An elastic layout=auto run's first start as Ray will likely place it on ``nodes``: (the
    config at its pick, workers a node, the lines that say why), None when the nodes hold no
    start yet (an autoscaler may add some). Refuses (ConfigError) when the planner fits none."""
    per_worker = worker_resources(cfg, use_gpu)
    counts = worker_counts(cfg)
    world = workers_that_fit(nodes, per_worker, cfg.parallelism.tp, counts)
    placed = predict_workers_per_node(nodes, world, per_worker, cfg.cluster.placement_strategy)
    if world not in counts or not placed:
        return None
    placed = sorted((c for c in placed if c), reverse=True)
    got = pick_for_group(cfg, placed, hw)
    if got is None:  # as a fixed-size pick that finds nothing: refused before any worker starts
        raise ConfigError(
            "parallelism.layout",
            "auto",
            f"no layout of the {world} workers the nodes hold now ({placed} a node) fits on {hw.name} "
            "(memory, TP inside a node, the global batch); add nodes or GPUs, or set parallelism.layout=fixed",
        )
    return got[0], placed, [f"{_EACH_START}; the first, as Ray will likely place {world}:", *got[1]]


_EACH_START = "layout auto: every start picks the layout of its workers"


def use_gpu_for(cfg: Config, nodes: list[dict[str, float]]) -> bool:
    """cluster.use_gpu, or when unset, whether the nodes have GPUs: the pick is then for GPU workers."""
    return cfg.cluster.use_gpu if cfg.cluster.use_gpu is not None else any(n.get("GPU", 0) for n in nodes)


def held_nodes(cfg: Config, held: list[int]) -> list[dict[str, float]]:
    """Nodes holding ``held`` workers each (`check --topology`): their CPUs, and a GPU each unless
    cluster.use_gpu=false."""
    gpu, cpus = cfg.cluster.use_gpu is not False, cfg.cluster.cpus_per_worker
    return [{"CPU": c * cpus, **({"GPU": c} if gpu else {})} for c in held]


def pick_for_check(
    cfg: Config, held: list[int] | None, say: Callable[[str], None], reach: Reach | None = None
) -> tuple[Config, list[int]]:
    """`check` with layout=auto: the pick for nodes holding ``held`` workers each (a GPU each
    unless cluster.use_gpu=false), or for the connected cluster's nodes (None; ``reach``: as read
    already); returns the
    config at the pick and the workers each node would get."""
    import ray

    if held is not None:
        gpu = cfg.cluster.use_gpu is not False
        reach = Reach([*held_nodes(cfg, held), {"CPU": 1}])  # and a head's CPU
    elif reach is not None or ray.is_initialized():
        reach = reach or cluster_reach(True, cfg.cluster.accelerator_type)
        gpu = use_gpu_for(cfg, reach.nodes)
    else:
        raise ConfigError(
            "parallelism.layout",
            "auto",
            "check picks for a cluster: run it where RAY_ADDRESS (or cluster.address) names one, or pass "
            "--topology with the workers each node holds (e.g. 4,4)",
        )
    if is_elastic(cfg.parallelism):  # the first start's pick (later ones pick for their own workers)
        first = first_start(cfg, reach.live, gpu, _priced_on(cfg, reach.nodes, gpu)[1])
        if first is None:
            raise ConfigError(
                "parallelism.layout",
                "auto",
                f"the nodes hold none of the worker counts {worker_counts(cfg)} (whole replicas of "
                f"tp*pp={cfg.parallelism.tp * cfg.parallelism.pp}); check with --topology the nodes the run will have",
            )
        for line in first[2]:
            say(line)
        return first[0], first[1]
    cfg, _ = choose_layout(cfg, say, reach, gpu)
    holds = [{"W": float(s)} for s in node_slots(cfg, reach.nodes, gpu)]
    counts = predict_workers_per_node(holds, cfg.parallelism.world_size, {"W": 1.0}, cfg.cluster.placement_strategy)
    return cfg, counts or []
