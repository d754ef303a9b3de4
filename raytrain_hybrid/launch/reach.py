"""The nodes a run may have: the live ones and, where Ray's autoscaler runs, the ones it may add.

`parallelism.layout=auto` picks for the most a cluster may reach (within parallelism.dp's bound):
a run that fits only once the autoscaler has added nodes asks for them, and the start-up watchdog
(launch.autoscale) waits while they join. Ray 2.60 publishes no node types to a driver: its
cluster status (either autoscaler) holds live and pending nodes only, and the GCS key that Ray
Train's own resource check reads (``ray._private.state.get_cluster_config``) is written by no
autoscaler of this version. What the autoscaler itself reads is its config: `ray up` puts it on
the head as ``~/ray_bootstrap_config.yaml`` with each node type's resources filled in (GPUs from
the instance type) and starts the autoscaler on it; Ray Tune tests for the same file. A driver
that `ray job submit` starts runs on the head, so it is read there and only there: on another
machine the file (if any) may be another cluster's, and a private local Ray has no autoscaler.
Not on KubeRay (its autoscaler reads the RayCluster through the Kubernetes API): there the pick
is for the live nodes, and an elastic run still grows (Ray Train asks the autoscaler for its
largest worker group).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

BOOTSTRAP = "~/ray_bootstrap_config.yaml"
_HEAD = "node:__internal_head__"  # the resource Ray gives the head node only


@dataclass(frozen=True)
class Reach:
    live: list[dict[str, float]]  # what each live node offers (Ray's totals)
    added: dict[str, tuple[int, dict[str, float]]] = field(default_factory=dict)  # type -> (nodes, one node)
    source: str = ""  # the autoscaler config read, if any
    note: str = ""  # why it was not

    @property
    def nodes(self) -> list[dict[str, float]]:
        """The live nodes and every node the autoscaler may add."""
        return self.live + [res for count, res in self.added.values() for _ in range(count)]

    def said(self) -> list[str]:
        """What was read, for a `layout auto:` line."""
        if self.note:
            return [f"{self.note}; picking for the live nodes"]
        if not self.added:
            return []
        adds = ", ".join(f"{n} x {name} {res}" for name, (n, res) in self.added.items())
        return [f"the autoscaler may add {adds} (max_workers in {self.source})"]


def may_add(
    config: dict, live: list[dict[str, float]], accelerator_type: str = ""
) -> dict[str, tuple[int, dict[str, float]]]:
    """The worker nodes an autoscaler with ``config`` (Ray's cluster config, filled in as `ray up`
    writes it) may still add beside the ``live`` nodes for a run's workers: each type up to its
    ``max_workers``, all types together up to the cluster's ``max_workers``, the types with the
    most GPUs (then CPUs) first; with ``accelerator_type`` (cluster.accelerator_type) only the types
    that declare it. A live worker node counts against its type when it offers what the type
    declares."""
    wanted = f"accelerator_type:{accelerator_type}"
    types = {
        name: node
        for name, node in (config.get("available_node_types") or {}).items()
        if name != config.get("head_node_type")
        and node.get("resources")
        and (not accelerator_type or wanted in node["resources"])
    }
    total_max = config.get("max_workers")
    if total_max is None:  # Ray's default for a type's max is the cluster's; without either, none
        total_max = sum(node.get("max_workers", 0) for node in types.values())
    workers = [n for n in live if _HEAD not in n]
    room = total_max - len(workers)
    added = {}
    for name, node in sorted(types.items(), key=lambda t: (-_get(t[1], "GPU"), -_get(t[1], "CPU"), t[0])):
        res = {k: float(v) for k, v in node["resources"].items()}
        up = sum(all(n.get(k, 0) == v for k, v in res.items()) for n in workers)
        count = min(node.get("max_workers", total_max) - up, room)
        if count > 0:
            added[name] = (count, res)
            room -= count
    return added


def cluster_reach(connected: bool, accelerator_type: str = "") -> Reach:
    """The connected cluster's reach for a run's workers (Ray initialized). ``connected``: Ray was
    joined at an address (a private local Ray has no autoscaler, whatever files this machine holds);
    ``accelerator_type``: cluster.accelerator_type."""
    from raytrain_hybrid.launch.placement import live_node_totals

    live = live_node_totals()
    path = Path(os.path.expanduser(BOOTSTRAP))
    if not connected or not path.is_file() or not _on_head():
        return Reach(live)
    try:
        config = yaml.safe_load(path.read_text()) or {}
        added = may_add(config, live, accelerator_type)
    except (yaml.YAMLError, AttributeError, TypeError, ValueError) as exc:  # not Ray's format: said, not fatal
        return Reach(live, note=f"{BOOTSTRAP} unreadable ({type(exc).__name__}: {exc})")
    return Reach(live, added, BOOTSTRAP)


def _on_head() -> bool:
    import ray

    here = ray.get_runtime_context().get_node_id()
    return any(n.get("Alive") and _HEAD in n["Resources"] and n["NodeID"] == here for n in ray.nodes())


def _get(node: dict, key: str) -> float:
    return float((node.get("resources") or {}).get(key, 0))
