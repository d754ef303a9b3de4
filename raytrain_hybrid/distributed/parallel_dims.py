"""Parallel degrees, the rank arrangement over nodes, and the DeviceMesh built from it.

The mesh is ``("pp", "dp_replicate", "dp_shard", "tp")`` with ``dp`` the flattened
pair: ZeRO-0 replicates along ``dp_replicate`` (HSDP with a shard group of one),
ZeRO-2/3 shard along ``dp_shard``. TP is innermost so that a TP group is a set of
consecutive slots, laid onto one node; PP is outermost so its stages go across nodes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from raytrain_hybrid.errors import LayoutError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the sub-meshes the engine uses, each by its axis."""

    world: Any  # DeviceMesh ("pp", "dp_replicate", "dp_shard", "tp")
    pp: Any
    dp: Any  # dp_replicate x dp_shard, flattened: one group per replica set
    tp: Any
    fsdp: Any  # ("dp_replicate", "dp_shard"): HSDP for zero=0, FSDP for zero=2/3
    replica: Any  # pp x tp flattened: the ranks of one data-parallel replica


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    zero: int = 0

    @classmethod
    def from_config(cls, parallelism) -> ParallelDims:
        """The degrees of a validated ``config.ParallelismConfig`` (the one place they are read)."""
        return cls(dp=parallelism.dp, tp=parallelism.tp, pp=parallelism.pp, zero=parallelism.zero)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dp_replicate(self) -> int:
        return self.dp if self.zero in (0, 1) else 1

    @property
    def dp_shard(self) -> int:
        return 1 if self.zero in (0, 1) else self.dp

    def coords(self, slot: int) -> dict[str, int]:
        """(pp, dp, tp) of a mesh slot in ("pp", "dp", "tp") row-major order."""
        return {"pp": slot // (self.dp * self.tp), "dp": (slot // self.tp) % self.dp, "tp": slot % self.tp}

    def build_mesh(self, device_type: str, arrangement: list[int]) -> Meshes:
        """DeviceMesh over ``arrangement`` (slot -> global rank) and its sub-meshes."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.tensor(arrangement, dtype=torch.int).reshape(self.pp, self.dp_replicate, self.dp_shard, self.tp)
        world = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
        fsdp = world["dp_replicate", "dp_shard"]
        return Meshes(
            world=world,
            pp=world["pp"],
            dp=fsdp._flatten("dp"),
            tp=world["tp"],
            fsdp=fsdp,
            replica=world["pp", "tp"]._flatten("replica"),
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
        raise LayoutError(f"{len(node_of_rank)} workers for dp*tp*pp={dims.dp}*{dims.tp}*{dims.pp}={dims.world_size}")
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
    slots = {tuple(dims.coords(s).values()): arrangement[s] for s in range(dims.world_size)}
    groups: dict[str, list[list[int]]] = {"tp": [], "dp": [], "pp": []}
    for p in range(dims.pp):
        for d in range(dims.dp):
            groups["tp"].append([slots[(p, d, t)] for t in range(dims.tp)])
    for p in range(dims.pp):
        for t in range(dims.tp):
            groups["dp"].append([slots[(p, d, t)] for d in range(dims.dp)])
    for d in range(dims.dp):
        for t in range(dims.tp):
            groups["pp"].append([slots[(p, d, t)] for p in range(dims.pp)])
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
    return {"ranks": ranks, "groups": axis_groups(dims, arrangement)}
