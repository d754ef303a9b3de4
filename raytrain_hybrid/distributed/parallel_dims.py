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

import bisect
import itertools
import math
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
    by_node: dict[str, list[int]] = defaultdict(list)
    for rank, node in enumerate(node_of_rank):
        by_node[node].append(rank)
    check_nodes(dims, [len(r) for r in by_node.values()])
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


def check_nodes(dims: ParallelDims, counts: list[int]) -> None:
    """Nodes holding ``counts`` workers take the layout with every TP group inside a node (a
    LayoutError naming the tp values that fit, else); work in the nodes, not the ranks."""
    if sum(counts) != dims.world_size:
        shape = f"dp*tp*pp={dims.dp}*{dims.tp}*{dims.pp}"
        if dims.cp > 1:
            shape = f"dp*cp*tp*pp={dims.dp}*{dims.cp}*{dims.tp}*{dims.pp}"
        raise LayoutError(f"{sum(counts)} workers for {shape}={dims.world_size}")
    bad = [c for c in counts if c % dims.tp]
    if bad:
        common = math.gcd(*counts)  # the tp values that fit: its divisors
        fits = sorted({d for i in range(1, math.isqrt(common) + 1) if common % i == 0 for d in (i, common // i)})
        raise LayoutError(
            f"tp={dims.tp} cannot keep every TP group inside one node: workers per node are "
            f"{counts}, and {bad[0]} is not a multiple of {dims.tp}. "
            f"Layouts that fit these nodes use tp in {fits}"
            + ("" if dims.tp <= max(counts) else f" (tp={dims.tp} is larger than any node)")
        )


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


# `check` lists at most this many ranks, and of each axis this many groups of at most this many
# ranks each: a layout of 200,000 ranks is summarized (its totals and node crossings counted),
# in work that grows with the nodes and what is listed, not with the ranks.
LISTED_RANKS = 256
LISTED_GROUPS = 64


def placement_report(dims: ParallelDims, workers_per_node: list[int]) -> dict:
    """Where the ranks land on nodes holding ``workers_per_node`` workers (Ray's rank order: one
    node's workers are consecutive, so the mesh takes them as they are), and the groups along
    each axis; a LayoutError when a TP group would cross nodes. At most LISTED_RANKS ranks and,
    per axis, LISTED_GROUPS groups of at most LISTED_GROUPS ranks are listed; "totals" says how
    many there are (ranks; per axis its groups and their size)."""
    check_nodes(dims, workers_per_node)
    ends = list(itertools.accumulate(workers_per_node))

    def node(rank: int) -> str:
        return f"node{bisect.bisect_right(ends, rank)}"

    ranks = [{"rank": r, "node": node(r), **dims.coords(r)} for r in range(min(dims.world_size, LISTED_RANKS))]
    shape = _group_shapes(dims)
    groups = {axis: _listed(stride, n, dims.world_size) for axis, (stride, n) in shape.items()}
    report = {"ranks": ranks, "groups": groups}
    if dims.cp > 1:
        report["cp_placement"] = cp_placement(dims, _crossing(*shape["cp"], ends))
    if dims.replicate > 1:
        shard, stride = dims.dp // dims.replicate, dims.cp * dims.tp
        shape["shard"], shape["replicate"] = (stride, shard), (stride * shard, dims.replicate)
        groups["shard"], groups["replicate"] = _hsdp_listed(dims)
        crossing = {k: _crossing(*shape[k], ends) for k in ("shard", "replicate")}
        report["hsdp_placement"], report["hsdp_where"] = hsdp_placement(dims, groups, crossing)
    report["totals"] = {"ranks": dims.world_size} | {
        axis: {"groups": dims.world_size // n, "size": n} for axis, (_, n) in shape.items()
    }
    return report


def _group_shapes(dims: ParallelDims) -> dict[str, tuple[int, int]]:
    """Per axis, (stride, size) of its groups: the ranks x, x + stride, ... (size of them), for
    every x whose coordinate on the axis is 0 ("pp", "dp", "cp", "tp" row-major, TP fastest)."""
    shape = {"tp": (1, dims.tp), "dp": (dims.cp * dims.tp, dims.dp), "pp": (dims.dp * dims.cp * dims.tp, dims.pp)}
    return shape | ({"cp": (dims.tp, dims.cp)} if dims.cp > 1 else {})


def _firsts(stride: int, n: int, world: int) -> list[int]:
    """The first ranks of the first LISTED_GROUPS groups of (stride, n) among ``world`` ranks: the
    x whose (x // stride) % n is 0, ascending (stride of them in every stride * n)."""
    return [(k // stride) * stride * n + k % stride for k in range(min(world // n, LISTED_GROUPS))]


def _listed(stride: int, n: int, world: int) -> list[list[int]]:
    """The first LISTED_GROUPS groups of (stride, n), each cut to its first LISTED_GROUPS ranks."""
    return [[x + j * stride for j in range(min(n, LISTED_GROUPS))] for x in _firsts(stride, n, world)]


def _hsdp_listed(dims: ParallelDims) -> tuple[list[list[int]], list[list[int]]]:
    """Of every dp group in turn, its shard groups (dp coordinates i*shard .. (i+1)*shard - 1)
    and its replica groups (j, j + shard, ...), listed as _listed lists."""
    step, shard, rep = dims.cp * dims.tp, dims.dp // dims.replicate, dims.replicate
    firsts = _firsts(step, dims.dp, dims.world_size)
    cut_shard, cut_rep = min(shard, LISTED_GROUPS), min(rep, LISTED_GROUPS)
    shards = ([x + (i * shard + j) * step for j in range(cut_shard)] for x in firsts for i in range(rep))
    replicas = ([x + (i + j * shard) * step for j in range(cut_rep)] for x in firsts for i in range(shard))
    return list(itertools.islice(shards, LISTED_GROUPS)), list(itertools.islice(replicas, LISTED_GROUPS))


def _crossing(stride: int, n: int, ends: list[int]) -> tuple[int, int]:
    """(groups that cross a node, all groups) of (stride, n) on nodes of consecutive ranks ending
    at ``ends``: a group is inside a node exactly when its first and last ranks are."""

    def firsts_below(x: int) -> int:  # groups whose first rank is below x
        return (x // (stride * n)) * stride + min(x % (stride * n), stride)

    inside, lo, span = 0, 0, (n - 1) * stride
    for hi in ends:
        if hi - span > lo:
            inside += firsts_below(hi - span) - firsts_below(lo)
        lo = hi
    return firsts_below(ends[-1]) - inside, firsts_below(ends[-1])


def hsdp_placement(dims: ParallelDims, groups: dict, crossing: dict[str, tuple[int, int]]) -> tuple[str, str]:
    """Where hybrid sharding's groups lie, in full (for `check`) and in short (the start line): the
    shard groups (the state's all-gathers and reduce-scatters) inside a node where dp/replicate x
    cp x tp workers fit one, the replica groups (one all-reduce of a shard's gradients a step) across.
    ``crossing``: per kind, (groups crossing a node, all groups)."""
    shard, (crossed, total), (across, replicas) = dims.dp // dims.replicate, crossing["shard"], crossing["replicate"]
    where = "inside a node" if not crossed else f"across nodes ({crossed} of {total})"
    there = f"across nodes ({across} of {replicas})" if across else "inside a node"
    listed = {k: f"{groups[k][:4]}{' ...' if crossing[k][1] > 4 else ''}" for k in ("shard", "replicate")}
    full = (
        f"hybrid sharding: dp={dims.dp} as replicate={dims.replicate} x shard={shard} (zero={dims.zero}): shard "
        f"groups {listed['shard']} {where}; replica groups {listed['replicate']} {there}, each step an all-reduce "
        f"of 1/{shard * dims.cp} of the stage's gradients between them"
    )
    return full, f"shard groups {where}, replica groups {there}"


def cp_placement(dims: ParallelDims, crossing: tuple[int, int]) -> str:
    """Where the cp groups lie: inside a node next to their TP groups (the all-to-alls stay on the
    node's links) when cp*tp workers fit in a node, else across nodes. ``crossing``: (cp groups
    crossing a node, all cp groups)."""
    crossed, total = crossing
    if not crossed:
        return f"cp groups stay inside a node: cp*tp={dims.cp * dims.tp} workers of a node exchange attention heads"
    return (
        f"cp groups cross nodes ({crossed} of {total}): cp*tp={dims.cp * dims.tp} does not fit the "
        "workers of a node, so the attention all-to-alls go over the network"
    )


def placement_lines(report: dict, ep: int = 1) -> list[str]:
    """placement_report as `check` prints it: the rank table, then each axis's groups (and the
    ep groups: each dp group's ep consecutive replicas share out the experts), saying what a
    summarized report left out."""
    cp = bool(report["ranks"]) and "cp" in report["ranks"][0]
    axes = ("pp", "dp", "cp", "tp") if cp else ("pp", "dp", "tp")
    lines = [f"{'rank':>4} {'node':>8} " + " ".join(f"{a:>3}" for a in axes)]
    for r in report["ranks"]:
        lines.append(f"{r['rank']:>4} {r['node']:>8} " + " ".join(f"{r[a]:>3}" for a in axes))
    totals = report["totals"]
    if (more := totals["ranks"] - len(report["ranks"])) > 0:
        lines.append(f"... and {more:,} more ranks (the first {len(report['ranks'])} of {totals['ranks']:,} listed)")
    groups = dict(report["groups"])
    if ep > 1:
        ep_groups = (g[i : i + ep] for g in groups["dp"] for i in range(0, len(g), ep))
        groups["ep"] = list(itertools.islice(ep_groups, LISTED_GROUPS))
    for axis, listed in groups.items():
        total = totals.get(axis)
        if total is None or (total["groups"] <= len(listed) and total["size"] <= LISTED_GROUPS):
            lines.append(f"{axis} groups: {listed}" + (" ..." if axis == "ep" and len(listed) == LISTED_GROUPS else ""))
        else:
            cut = f", each cut to its first {LISTED_GROUPS} ranks" if total["size"] > LISTED_GROUPS else ""
            lines.append(
                f"{axis} groups ({total['groups']:,} of {total['size']:,} ranks each; the first {len(listed)} listed"
                f"{cut}): {listed} ..."
            )
    return lines
