"""The start-up watchdog: what Ray's autoscaler says about the workers a run asked for.

On an autoscaling cluster "no step yet" is often just a node still joining (a p5 takes 10-15
minutes), so the start-up clock starts again whenever the autoscaler is seen adding nodes; and a
worker no node type can hold will never be placed, so the run stops as soon as the autoscaler
says so instead of waiting out the clock. A fixed cluster (a hand-made `ray start` head, a local
Ray) keeps the plain clock: ``preflight.check_placement`` already refused what its nodes cannot hold.
Any growth counts (the autoscalers do not say which demand a launch serves), and a cloud that keeps
refusing launches (quota, no capacity) keeps the run waiting as the autoscaler keeps trying.

Ray 2.60 has two autoscalers, and they publish different things:

- v2 (``RAY_enable_autoscaler_v2=1``, KubeRay's ``autoscalerOptions.version: v2``): the GCS's
  cluster status holds its pending launches and nodes and the infeasible (gang) requests.
- v1 (the default of ``ray up`` and KubeRay): its status in the GCS's KV (what ``ray status``
  prints) holds the pending launches and nodes; infeasibility reaches only its events ("No
  available node types can fulfill resource request {...}"), which the dashboard keeps as
  cluster events. Without a dashboard the clock alone decides.

Both run on a fixed cluster too, with Ray's read-only provider whose node types mirror the live
nodes (``node_<node id>``): nothing is ever launched there, so such a cluster counts as fixed.
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from raytrain_hybrid.errors import ConfigError

POLL_S = 2.0  # the autoscaler acts every 5 s by default; the dashboard scans events every 2 s
# v1 repeats an infeasibility event at most every 30 s: one from shortly before this run's
# request is still its verdict on the same bundle (node types do not change under a run).
EVENT_LOOKBACK_S = 30.0
_READONLY_TYPE = re.compile(r"node_[0-9a-f]{56}")  # ray.autoscaler._private.util.format_readonly_node_type
_INFEASIBLE = re.compile(r"No available node types can fulfill resource requests? (\{[^}]*\})")


class StartupTimeout(RuntimeError):
    """The run did not reach its first step in time; the message says what Ray waits for."""


class InfeasibleDemand(ConfigError):
    """Ray's autoscaler has no node type that can hold one worker of the run."""


@dataclass(frozen=True)
class ScalerState:
    """One look at the cluster's autoscaler (recordable: plain data, see tests/test_autoscale.py)."""

    autoscaler: bool  # False: a fixed cluster (no autoscaler, or Ray's read-only mirror of the nodes)
    launching: dict[str, int] = field(default_factory=dict)  # node type -> nodes requested or still joining
    infeasible: tuple[dict[str, float], ...] = ()  # bundles the autoscaler says no node type can hold
    nodes: dict[str, dict[str, float]] = field(default_factory=dict)  # node type -> what one node offers


FIXED = ScalerState(autoscaler=False)


def is_multiple(bundle: dict[str, float], demand: dict[str, float]) -> bool:
    """``bundle`` is ``demand`` times a whole number: one worker's bundle, or a STRICT_PACK group's
    bundles summed into one (how both autoscalers present that strategy)."""
    if set(bundle) != set(demand) or not demand:
        return False
    k = next(iter(demand))
    ratio = bundle[k] / demand[k] if demand[k] else 0.0
    return (
        ratio >= 1 - 1e-6
        and math.isclose(ratio, round(ratio), rel_tol=1e-6)
        and all(math.isclose(bundle[r], ratio * demand[r], rel_tol=1e-6, abs_tol=1e-9) for r in demand)
    )


class StartupWatchdog:
    """Decides, from what the autoscaler says, whether a run without a step yet goes on waiting.

    ``demand`` is one worker's bundle as Ray sees it (resources_per_worker, plus
    ``accelerator_type:X: 0.001`` for cluster.accelerator_type); ``key`` the config key and value
    an infeasibility error names. ``timeout_s`` 0 waits forever, but an infeasible demand still
    stops the run.
    """

    def __init__(self, demand: dict[str, float], timeout_s: float, key: tuple[str, object]):
        self.demand, self.timeout_s, self.key = demand, timeout_s, key
        self.started = self.clock_from = time.time()  # the start-up clock runs from clock_from
        self.launching: dict[str, int] = {}  # what the autoscaler was last seen adding
        self.news: list[str] = []  # lines for the driver's log

    @classmethod
    def for_run(cls, cluster, resources: dict[str, float], timeout_s: float) -> StartupWatchdog:
        """``cluster``: the run's ClusterConfig; ``resources``: what each worker asks of Ray."""
        demand = {k: v for k, v in resources.items() if v}  # Ray Train drops zeros too
        if cluster.accelerator_type:  # how Ray Train's ScalingConfig(accelerator_type=X) asks for it
            demand[f"accelerator_type:{cluster.accelerator_type}"] = 0.001
        if cluster.accelerator_type:
            key = ("cluster.accelerator_type", cluster.accelerator_type)
        elif "GPU" in demand:
            key = ("cluster.use_gpu", cluster.use_gpu)
        else:
            key = ("cluster.cpus_per_worker", cluster.cpus_per_worker)
        return cls(demand, timeout_s, key)

    def start(self, at: float) -> None:
        """The workers were asked for at ``at``."""
        self.started = self.clock_from = at

    def check(self, state: ScalerState | None, now: float) -> str | None:
        """Raises InfeasibleDemand; returns why the clock ran out (the caller adds what Ray waits
        for and raises StartupTimeout), or None to wait on. ``state`` None: the autoscaler could not
        be read, so the plain clock decides."""
        if state is not None and state.autoscaler:
            if any(is_multiple(b, self.demand) for b in state.infeasible):
                raise InfeasibleDemand(*self.key, infeasible_fix(self.demand, state, now - self.started))
            if state.launching:
                # Growing: the workers may be waiting for exactly these nodes. Once they have
                # joined, the workers still get the whole budget for their own start (image pull,
                # CUDA, model build), so the clock starts again rather than pausing.
                self.clock_from = now
                if state.launching != self.launching:
                    what = ", ".join(f"{n} x {t}" for t, n in sorted(state.launching.items()))
                    self.news.append(f"waiting for nodes: the autoscaler is adding {what}")
                self.launching = state.launching
        if self.timeout_s and now - self.clock_from > self.timeout_s:
            since = " since the autoscaler last added nodes" if self.launching else ""
            return f"no training step after {self.timeout_s:g} s{since} (run.startup_timeout_s)"
        return None


def infeasible_fix(demand: dict[str, float], state: ScalerState, after_s: float) -> str:
    kinds = "; ".join(f"{name} {res}" for name, res in sorted(state.nodes.items())) or "none up yet"
    accels = sorted(
        {k.split(":", 1)[1] for res in state.nodes.values() for k in res if k.startswith("accelerator_type:")}
    )
    fixes = []
    if any(k.startswith("accelerator_type:") for k in demand):
        offered = f"one the node types declare ({', '.join(accels)})" if accels else "one a node type declares"
        fixes.append(f'set cluster.accelerator_type to {offered}, or to "" to take any GPU')
    fixes.append(
        "give the cluster a node type whose resources hold one worker (launcher YAML: "
        "available_node_types.<type>.resources; KubeRay: the worker group's rayStartParams)"
    )
    return (
        f"Ray's autoscaler reports a worker's demand {demand} infeasible for every node type of this "
        f"cluster ({after_s:.0f} s after the workers were asked for): the run would wait forever. Node "
        f"types seen (up now; one node's resources): "
        f"{kinds}. Fix: {'; or '.join(fixes)}."
    )


class ScalerProbe:
    """Reads the autoscaler's state from the GCS (and, for v1, the dashboard's cluster events);
    ``from_v1`` / ``from_v2`` turn what it read into a ScalerState."""

    def __init__(self, since: float):
        self.since = since - EVENT_LOOKBACK_S
        self.gcs = None

    def read(self) -> ScalerState | None:
        import ray

        try:
            if self.gcs is None:
                self.gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
            v2 = self.gcs.internal_kv_get(
                ray._raylet.GCS_AUTOSCALER_V2_ENABLED_KEY.encode(),
                namespace=ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode(),
            )
            if v2 == b"1":
                return from_v2(self.gcs.get_cluster_status(timeout_s=10), ray.nodes())
            raw = self.gcs.internal_kv_get(b"__autoscaling_status", None)  # ray_constants.DEBUG_AUTOSCALING_STATUS
            status = json.loads(raw) if raw else {}
            if not _types_v1(status):
                return FIXED
            return from_v1(status, self._events(), ray.nodes(), self.since)
        except Exception:  # an unreadable autoscaler (an older head, a busy GCS): the plain clock decides
            return None

    @staticmethod
    def _events() -> list[dict]:
        """The autoscaler's cluster events as {"message", "time"} ("time" as the dashboard writes it)."""
        import ray
        from ray.util.state import list_cluster_events

        try:
            events = list_cluster_events(
                address=ray.get_runtime_context().gcs_address,  # not the newest Ray on this machine
                filters=[("source_type", "=", "AUTOSCALER")],
                limit=10_000,
                timeout=10,
                raise_on_missing_output=False,
            )
        except Exception:  # no dashboard: growth is still seen, infeasibility only by the clock
            return []
        return [{"message": e["message"], "time": e["time"]} for e in events]


def from_v2(reply: bytes, nodes: list[dict]) -> ScalerState:
    """From the GCS's GetClusterStatusReply (autoscaler v2) and ``ray.nodes()``."""
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    status = GetClusterStatusReply()
    status.ParseFromString(reply)
    st = status.autoscaling_state
    launching: Counter = Counter()
    for r in st.pending_instance_requests:
        launching[r.ray_node_type_name] += r.count
    for i in st.pending_instances:
        launching[i.ray_node_type_name] += 1
    infeasible = [dict(r.resources_bundle) for g in st.infeasible_gang_resource_requests for r in g.requests]
    infeasible += [dict(r.resources_bundle) for r in st.infeasible_resource_requests]
    type_of = {n.node_id.hex(): n.ray_node_type_name for n in status.cluster_resource_state.node_states}
    return _state(set(type_of.values()) | set(launching), dict(launching), infeasible, nodes, type_of)


def _types_v1(status: dict) -> set[str]:
    report = status.get("autoscaler_report") or {}
    pending = {p[-2] for p in report.get("pending_nodes") or []}  # ([node id,] ip or id, type, status)
    known = set((report.get("node_type_mapping") or {}).values())  # every node's, the head's too
    return known | set(report.get("active_nodes") or {}) | pending | set(report.get("pending_launches") or {})


def from_v1(status: dict, events: list[dict], nodes: list[dict], since: float) -> ScalerState:
    """From autoscaler v1's status (the GCS KV's ``__autoscaling_status``, JSON), its cluster
    events (``ScalerProbe._events``) and ``ray.nodes()``."""
    report = status.get("autoscaler_report") or {}
    launching: Counter = Counter({t: n for t, n in (report.get("pending_launches") or {}).items() if n})
    for pending in report.get("pending_nodes") or []:
        launching[pending[-2]] += 1
    infeasible = []
    for event in events:
        match = _INFEASIBLE.search(event["message"])
        # "time" is the dashboard's str(datetime.fromtimestamp(t)): local time on the head, where
        # a job's driver runs too; whole seconds.
        if match and datetime.fromisoformat(event["time"]).timestamp() >= since - 1:
            infeasible.append(ast.literal_eval(match.group(1)))
    # v1 maps node IPs to types (the fake provider's IPs are node ids).
    return _state(_types_v1(status), dict(launching), infeasible, nodes, report.get("node_type_mapping") or {})


def _state(
    types: set[str], launching: dict[str, int], infeasible: list[dict], nodes: list[dict], type_of: dict[str, str]
) -> ScalerState:
    if not types or all(_READONLY_TYPE.fullmatch(t) for t in types):
        return FIXED
    kinds = node_types(nodes, type_of)
    return ScalerState(autoscaler=True, launching=launching, infeasible=tuple(infeasible), nodes=kinds)


def node_types(nodes: list[dict], type_of: dict[str, str]) -> dict[str, dict[str, float]]:
    """One node's resources per node type, from the nodes up now (``ray.nodes()``; ``type_of``:
    node id or IP -> type, as the autoscaler reports it): neither autoscaler publishes the types
    it could launch."""
    kinds: dict[str, dict[str, float]] = {}
    for node in nodes:
        offers = {k: v for k, v in sorted(node["Resources"].items()) if not _internal(k)}
        if not node.get("Alive") or not offers:  # e.g. a head with no CPUs for work
            continue
        name = (
            (node.get("Labels") or {}).get("ray.io/node-group")
            or type_of.get(node["NodeID"])
            or type_of.get(node.get("NodeManagerAddress", ""))
            or f"node {node['NodeID'][:8]}"
        )
        kinds.setdefault(name, offers)
    return kinds


def _internal(resource: str) -> bool:
    return resource in ("memory", "object_store_memory") or resource.startswith("node:")
