"""Parallel degrees, the rank arrangement over nodes, and the DeviceMesh built from it.

The mesh is ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` with ``dp`` the flattened
pair: ZeRO-0 replicates along ``dp_replicate`` (HSDP with a shard group of one),
ZeRO-1/2/3 shard along ``dp_shard`` and, with ``replicate`` > 1 (hybrid sharding, TorchTitan's
data_parallel_replicate_degree), keep ``replicate`` copies of the sharded state along
``dp_replicate``: a shard group of dp/replicate consecutive dp ranks (inside a node where it
fits), the replica groups across them. TP is innermost so that a TP group is a set of
consecutive slots, laid onto one node; context parallelism (``cp``, each rank a slice of
the sequence) sits next to it, so that cp x tp stays inside a node where it fits; PP is
outermost so its stages go across nodes. Gradients are reduced over dp x cp: the cp ranks
of a replica hold the same parameters and different tokens (FSDP shards over dp_shard x cp,
as TorchTitan does; ZeRO-0 replicates over dp_replicate x cp).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from raytrain_hybrid.errors import LayoutError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the sub-meshes the engine uses, each by its axis."""

    world: Any  # DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    pp: Any
    dp: Any  # dp_replicate x dp_shard, flattened: one group per replica set
    tp: Any
    fsdp: Any  # (replicate, shard): HSDP over dp_replicate x cp for zero=0, FSDP over dp_shard x cp for zero=2/3
    replica: Any  # pp x cp x tp flattened: the ranks of one data-parallel replica (same rows)
    cp: Any = None  # the ranks that split one sequence (context parallelism)
    grads: Any = None  # dp x cp flattened: the ranks whose gradients are averaged (ZeRO-1's group)
    shard: Any = None  # dp_shard (x cp): the ranks sharing one copy of the state (ZeRO-1 under replicate > 1)
    replicate: Any = None  # dp_replicate: the copies of the sharded state (their gradients all-reduced)


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The parallel degrees of a layout, checked at construction; one is passed explicitly.

    ``ParallelDims.from_config(cfg.parallelism)`` reads them off a config.

    Args:
        dp: data-parallel replicas.
        tp: tensor-parallel ranks (inside one node).
        pp: pipeline stages.
        zero: 0 DDP, 1 optimizer state sharded, 2 and 3 FSDP2 (gradients, then parameters sharded).
        cp: ranks that split one sequence (context parallelism).
        ep: dp ranks the experts of a mixture of experts are sharded over.
        replicate: hybrid sharding, dp = replicate x shard.

    Raises:
        ValueError: a degree below 1, or a ``replicate`` that does not divide dp or comes with zero=0.
    """

    dp: int
    tp: int
    pp: int
    zero: int = 0
    cp: int = 1  # context parallelism: the sequence split over this many ranks of a replica
    ep: int = 1  # expert parallelism: experts sharded over this many dp ranks (distributed.expert_parallel)
    replicate: int = 1  # hybrid sharding: dp = replicate x shard, the state sharded inside a shard group

    @classmethod
    def from_config(cls, parallelism) -> ParallelDims:
        """The degrees of a validated ``config.ParallelismConfig`` (the one place they are read)."""
        return cls(
            dp=parallelism.dp,
            tp=parallelism.tp,
            pp=parallelism.pp,
            zero=parallelism.zero,
            cp=parallelism.cp,
            ep=parallelism.ep,
            replicate=parallelism.replicate,
        )

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "replicate"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dp % self.replicate or (self.replicate > 1 and self.zero == 0):
            raise ValueError(f"replicate={self.replicate} needs zero >= 1 and to divide dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_replicate(self) -> int:
        return self.dp if self.zero == 0 else self.replicate

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def coords(self, slot: int) -> dict[str, int]:
        """(pp, dp, [cp,] tp) of a mesh slot in ("pp", "dp", "cp", "tp") row-major order (cp only when > 1)."""
        tp, cp, dp = self.tp, self.cp, self.dp
        out = {"pp": slot // (dp * cp * tp), "dp": (slot // (cp * tp)) % dp}
        if cp > 1:
            out["cp"] = (slot // tp) % cp
        return {**out, "tp": slot % tp}

    def build_mesh(self, device_type: str, arrangement: list[int]) -> Meshes:
        """DeviceMesh over ``arrangement`` (slot -> global rank) and its sub-meshes."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        ranks = torch.tensor(arrangement, dtype=torch.int).reshape(shape)
        world = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
        dp = world["dp_replicate", "dp_shard"]
        shard = world["dp_shard"]
        if self.cp == 1:
            fsdp = dp
        elif self.zero == 0:  # cp replicates like dp: HSDP (dp_replicate x cp, shard group of one)
            fsdp = DeviceMesh._concatenate([world["dp_replicate", "cp"]._flatten("dp_replicate_cp"), world["dp_shard"]])
        else:  # FSDP and ZeRO-1 shard over dp_shard x cp (TorchTitan's dp_shard_cp)
            shard = world["dp_shard", "cp"]._flatten("dp_shard_cp")
            fsdp = DeviceMesh._concatenate([world["dp_replicate"], shard])
        return Meshes(
            world=world,
            pp=world["pp"],
            dp=dp._flatten("dp"),
            tp=world["tp"],
            fsdp=fsdp,
            replica=world["pp", "cp", "tp"]._flatten("replica"),
            cp=world["cp"],
            grads=world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp") if self.cp > 1 else None,
            shard=shard,
            replicate=world["dp_replicate"],
        )


def arrange_ranks(dims: ParallelDims, node_of_rank: list[str]) -> list[int]:
    """Slot -> rank so that every TP group sits on one node and PP goes across nodes.

    Ranks are taken node by node (nodes in order of their lowest rank, ranks
    ascending inside a node) and laid into the mesh in row-major order, TP
    fastest. This is Ray Train's own order when it hands ranks out by node
    (the identity). When the ranks of a node are not consecutive, the identity
    is kept if it already holds every TP group on one node: torch's DeviceMesh
    numbers a group's members by ascending global rank, so a group whose ranks
    descend along its axis would give its ranks the wrong coordinates (seen:
    a rank building pipeline stage 0 among the ranks of stage 1). A node whose
    worker count tp does not divide would split a TP group, so it is refused
    with the layouts that would fit, as is an order no mesh can take.
    """
    if len(node_of_rank) != dims.world_size:
        shape = f"dp*tp*pp={dims.dp}*{dims.tp}*{dims.pp}"
        if dims.cp > 1:
            shape = f"dp*cp*tp*pp={dims.dp}*{dims.cp}*{dims.tp}*{dims.pp}"
        raise LayoutError(f"{len(node_of_rank)} workers for {shape}={dims.world_size}")
    by_node: dict[str, list[int]] = defaultdict(list)
    for rank, node in enumerate(node_of_rank):
        by_node[node].append(rank)
    counts = [len(r) for r in by_node.values()]
    bad = [c for c in counts if c % dims.tp]
    if bad:
        fits = sorted({t for t in range(1, max(counts) + 1) if all(c % t == 0 for c in counts)})
        raise LayoutError(
            f"tp={dims.tp} cannot keep every TP group inside one node: workers per node are "
            f"{counts}, and {bad[0]} is not a multiple of {dims.tp}. "
            f"Layouts that fit these nodes use tp in {fits}"
            + ("" if dims.tp <= max(counts) else f" (tp={dims.tp} is larger than any node)")
        )
    identity = list(range(dims.world_size))
    if all(len({node_of_rank[r] for r in group}) == 1 for group in axis_groups(dims, identity)["tp"]):
        return identity
    arrangement = [rank for ranks in by_node.values() for rank in ranks]
    for axis, groups in axis_groups(dims, arrangement).items():
        for group in groups:
            if group != sorted(group):
                raise LayoutError(
                    f"the workers' ranks alternate between nodes ({node_of_rank}) in an order no mesh with TP "
                    f"groups inside a node can take: the {axis} group {group} would not ascend (torch's DeviceMesh "
                    "needs it to); start the workers grouped by node (Ray Train's order) or use tp=1"
                )
    return arrangement


def axis_groups(dims: ParallelDims, arrangement: list[int]) -> dict[str, list[list[int]]]:
    """Global ranks of every group along each axis, for display and checks."""
    sizes = {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp}
    slots = {}
    for s in range(dims.world_size):
        c = dims.coords(s)
        slots[(c["pp"], c["dp"], c.get("cp", 0), c["tp"])] = arrangement[s]
    axes = ("pp", "dp", "cp", "tp")
    groups: dict[str, list[list[int]]] = {}
    for axis in ("tp", "dp", "pp", "cp") if dims.cp > 1 else ("tp", "dp", "pp"):
        i = axes.index(axis)
        others = [a for a in axes if a != axis]
        out = groups.setdefault(axis, [])
        for rest in itertools.product(*(range(sizes[a]) for a in others)):
            key = list(rest)
            out.append([slots[tuple(key[:i] + [v] + key[i:])] for v in range(sizes[axis])])
    return groups


def placement_report(dims: ParallelDims, workers_per_node: list[int]) -> dict:
    """Where every rank lands on nodes holding ``workers_per_node`` workers (Ray's rank order:
    one node's workers are consecutive), and the groups along each axis; a LayoutError when
    a TP group would cross nodes."""
    nodes = [f"node{i}" for i, c in enumerate(workers_per_node) for _ in range(c)]
    arrangement = arrange_ranks(dims, nodes)
    ranks = sorted(
        ({"rank": rank, "node": nodes[rank], **dims.coords(slot)} for slot, rank in enumerate(arrangement)),
        key=lambda r: r["rank"],
    )
    groups = axis_groups(dims, arrangement)
    report = {"ranks": ranks, "groups": groups}
    if dims.cp > 1:
        report["cp_placement"] = cp_placement(dims, groups["cp"], nodes)
    if dims.replicate > 1:
        shard = dims.dp // dims.replicate
        groups["shard"] = [g[i : i + shard] for g in groups["dp"] for i in range(0, dims.dp, shard)]
        groups["replicate"] = [g[i::shard] for g in groups["dp"] for i in range(shard)]
        report["hsdp_placement"], report["hsdp_where"] = hsdp_placement(dims, groups, nodes)
    return report


def _crossing(groups: list[list[int]], node_of_rank: list[str]) -> int:
    return sum(len({node_of_rank[r] for r in g}) > 1 for g in groups)


def hsdp_placement(dims: ParallelDims, groups: dict, node_of_rank: list[str]) -> tuple[str, str]:
    """Where hybrid sharding's groups lie, in full (for `check`) and in short (the start line): the
    shard groups (the state's all-gathers and reduce-scatters) inside a node where dp/replicate x
    cp x tp workers fit one, the replica groups (one all-reduce of a shard's gradients a step) across."""
    shard, crossing = dims.dp // dims.replicate, _crossing(groups["shard"], node_of_rank)
    across = _crossing(groups["replicate"], node_of_rank)
    where = "inside a node" if not crossing else f"across nodes ({crossing} of {len(groups['shard'])})"
    there = f"across nodes ({across} of {len(groups['replicate'])})" if across else "inside a node"
    listed = {k: f"{groups[k][:4]}{' ...' if len(groups[k]) > 4 else ''}" for k in ("shard", "replicate")}
    full = (
        f"hybrid sharding: dp={dims.dp} as replicate={dims.replicate} x shard={shard} (zero={dims.zero}): shard "
        f"groups {listed['shard']} {where}; replica groups {listed['replicate']} {there}, each step an all-reduce "
        f"of 1/{shard * dims.cp} of the stage's gradients between them"
    )
    return full, f"shard groups {where}, replica groups {there}"


def cp_placement(dims: ParallelDims, cp_groups: list[list[int]], node_of_rank: list[str]) -> str:
    """Where the cp groups lie: inside a node next to their TP groups (the all-to-alls stay on the
    node's links) when cp*tp workers fit in a node, else across nodes."""
    crossing = sum(len({node_of_rank[r] for r in g}) > 1 for g in cp_groups)
    if not crossing:
        return f"cp groups stay inside a node: cp*tp={dims.cp * dims.tp} workers of a node exchange attention heads"
    return (
        f"cp groups cross nodes ({crossing} of {len(cp_groups)}): cp*tp={dims.cp * dims.tp} does not fit the "
        "workers of a node, so the attention all-to-alls go over the network"
    )
