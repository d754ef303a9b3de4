"""The nodes a run may have: the live ones and, where Ray's autoscaler runs, the ones it may add.

`parallelism.layout=auto` picks for the most a cluster may reach (within parallelism.dp's bound):
a run that fits only once the autoscaler has added nodes asks for them, and the start-up watchdog
(launch.runtime.autoscale) waits while they join. Ray 2.60 publishes no node types to a driver: its
cluster status (either autoscaler) holds live and pending nodes only, and the GCS key that Ray
Train's own resource check reads (``ray._private.state.get_cluster_config``) is written by no
autoscaler of this version. What the autoscaler itself reads is its config: `ray up` puts it on
the head as ``~/ray_bootstrap_config.yaml`` with each node type's resources filled in (GPUs from
the instance type) and starts the autoscaler on it; Ray Tune tests for the same file. A driver
that `ray job submit` starts runs on the head, so it is read there and only there: on another
machine the file (if any) may be another cluster's, and a private local Ray has no autoscaler.
On KubeRay the autoscaler reads the RayCluster through the Kubernetes API instead, the head pod's
service account allowed to by the Role KubeRay makes for it; the pods carry the cluster's name
(RAY_CLUSTER_NAME) and the API server's address. It is read there the autoscaler's way (Ray's own
client and RayCluster-to-config translation), and only with the RayCluster's in-tree autoscaler on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

BOOTSTRAP = "~/ray_bootstrap_config.yaml"
_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"  # a pod's own namespace
_HEAD = "node:__internal_head__"  # the resource Ray gives the head node only


@dataclass(frozen=True)
class Reach:
    live: list[dict[str, float]]  # what each live node offers (Ray's totals)
    added: dict[str, tuple[int, dict[str, float]]] = field(default_factory=dict)  # type -> (nodes, one node)
    source: str = ""  # the autoscaler config read, if any
    note: str = ""  # why it was not
    bound: str = "max_workers"  # what caps each node type there

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
        return [f"the autoscaler may add {adds} ({self.bound} in {self.source})"]


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
    from raytrain_hybrid.launch.plan.placement import live_node_totals

    live = live_node_totals()
    path = Path(os.path.expanduser(BOOTSTRAP))
    from_file = path.is_file()
    kuberay = os.environ.get("RAY_CLUSTER_NAME") and os.environ.get("KUBERNETES_SERVICE_HOST")
    if not connected or not (from_file or kuberay) or not _on_head():
        return Reach(live)
    if from_file:
        source, bound = BOOTSTRAP, "max_workers"
    else:
        namespace, name = _namespace(), os.environ["RAY_CLUSTER_NAME"]
        source, bound = f"RayCluster {namespace}/{name}", "maxReplicas"
    try:
        config = (yaml.safe_load(path.read_text()) or {}) if from_file else _raycluster_config(namespace, name)
        if config is None:  # a RayCluster without its autoscaler: the live nodes are all there is
            return Reach(live)
        added = may_add(config, live, accelerator_type)
    except (yaml.YAMLError, AttributeError, TypeError, ValueError, KeyError, OSError) as exc:
        # Not Ray's format, or the API refused (requests' errors are OSErrors): said, not fatal.
        return Reach(live, note=f"{source} unreadable ({type(exc).__name__}: {exc})")
    return Reach(live, added, source, bound=bound)


def _namespace() -> str:
    """The RayCluster's namespace: KubeRay's variable (newer operators), else the pod's own."""
    if os.environ.get("RAY_CLUSTER_NAMESPACE"):
        return os.environ["RAY_CLUSTER_NAMESPACE"]
    try:
        return Path(_NAMESPACE_FILE).read_text().strip()
    except OSError:
        return "default"


def _raycluster_config(namespace: str, name: str) -> dict | None:
    """This pod's RayCluster as the config Ray's autoscaler derives from it (one node type per
    worker group, maxReplicas its max_workers, resources from rayStartParams and the container
    limits), read as the KubeRay autoscaler reads it (in-cluster token and CA, or the client
    certificate of RAY_KUBERAY_CLIENT_CERT_PATH); None when its in-tree autoscaler is off."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    from ray.autoscaler._private.kuberay.node_provider import KubernetesHttpApiClient

    cr = KubernetesHttpApiClient(namespace).get(f"rayclusters/{name}")
    if not cr["spec"].get("enableInTreeAutoscaling"):
        return None
    return _derive_autoscaling_config_from_ray_cr(cr)


def _on_head() -> bool:
    import ray

    here = ray.get_runtime_context().get_node_id()
    return any(n.get("Alive") and _HEAD in n["Resources"] and n["NodeID"] == here for n in ray.nodes())


def _get(node: dict, key: str) -> float:
    return float((node.get("resources") or {}).get(key, 0))
