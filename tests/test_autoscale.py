"""The start-up watchdog's decisions on recorded autoscaler states, without Ray: a cluster that
is still adding nodes is waited for, a demand no node type can hold stops the run at once, and a
fixed cluster keeps the plain clock. tests/test_autoscaling_sim.py runs it against Ray's own
autoscaler."""

from __future__ import annotations

import signal
import subprocess
import sys
from datetime import datetime

import pytest

from raytrain_hybrid.config.schema import ClusterConfig
from raytrain_hybrid.launch.runtime.autoscale import (
    FIXED,
    InfeasibleDemand,
    ScalerState,
    StartupWatchdog,
    from_v1,
    from_v2,
    is_multiple,
)

H100 = {"CPU": 1.0, "GPU": 1, "accelerator_type:H100": 0.001}
B200 = {"CPU": 1.0, "GPU": 1, "accelerator_type:B200": 0.001}
P5 = {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H100": 1.0}
T0 = 1_000_000.0


def watchdog(demand=H100, timeout_s=900.0, key=("cluster.accelerator_type", "H100")) -> StartupWatchdog:
    dog = StartupWatchdog(demand, timeout_s, key)
    dog.start(T0)
    return dog


def test_a_growing_cluster_is_waited_for_and_the_workers_then_get_the_whole_budget():
    """A p5 takes ~15 minutes to join: with a 900 s budget the run waits the whole boot, then
    900 s more for its workers to start; only then does the clock run out."""
    dog = watchdog()
    booting = ScalerState(autoscaler=True, launching={"gpu_h100_8x": 1}, nodes={})
    for t in range(0, 15 * 60, 30):  # the autoscaler reports the node pending the whole time
        assert dog.check(booting, T0 + t) is None
    assert dog.news == ["waiting for nodes: the autoscaler is adding 1 x gpu_h100_8x"]
    joined = ScalerState(autoscaler=True, nodes={"gpu_h100_8x": P5})
    last_seen = T0 + 15 * 60 - 30
    assert dog.check(joined, last_seen + 899) is None
    why = dog.check(joined, last_seen + 901)
    assert why == "no training step after 900 s since the autoscaler last added nodes (run.startup_timeout_s)"


def test_a_demand_no_node_type_holds_stops_the_run_at_once_even_without_a_timeout():
    dog = watchdog(B200, timeout_s=0, key=("cluster.accelerator_type", "B200"))
    # The autoscaler is busy with another run's node meanwhile: infeasible still wins.
    state = ScalerState(autoscaler=True, launching={"gpu_h100_8x": 1}, infeasible=(B200,), nodes={"gpu_h100_8x": P5})
    with pytest.raises(InfeasibleDemand) as err:
        dog.check(state, T0 + 3)
    msg = str(err.value)
    assert msg.startswith("cluster.accelerator_type='B200': ")
    assert "{'CPU': 1.0, 'GPU': 1, 'accelerator_type:B200': 0.001} infeasible for every node type" in msg
    assert "(3 s after the workers were asked for)" in msg
    assert "gpu_h100_8x {'CPU': 192.0, 'GPU': 8.0, 'accelerator_type:H100': 1.0}" in msg
    assert 'set cluster.accelerator_type to one the node types declare (H100), or to "" to take any GPU' in msg
    assert "available_node_types.<type>.resources" in msg
    # Another run's infeasible demand is not this run's.
    other = watchdog(H100, timeout_s=0)
    assert other.check(state, T0 + 3) is None


def test_a_strict_pack_group_is_matched_by_its_summed_bundle():
    assert is_multiple({"CPU": 8.0, "GPU": 8.0, "accelerator_type:B200": 0.008}, B200)
    assert is_multiple(B200, B200)
    assert not is_multiple({"CPU": 8.0, "GPU": 4.0, "accelerator_type:B200": 0.008}, B200)
    assert not is_multiple({"CPU": 0.5, "GPU": 0.5, "accelerator_type:B200": 0.0005}, B200)
    assert not is_multiple({"CPU": 1.0, "GPU": 1.0}, B200)


@pytest.mark.parametrize("state", [FIXED, None], ids=["fixed cluster", "unreadable"])
def test_a_fixed_cluster_keeps_the_plain_clock(state):
    dog = watchdog(timeout_s=15)
    assert dog.check(state, T0 + 14) is None
    assert dog.check(state, T0 + 16) == "no training step after 15 s (run.startup_timeout_s)"
    # An "infeasible" verdict is only taken from an autoscaler (on a fixed cluster the preflight
    # check refuses such demands); 0 still waits forever.
    assert watchdog(timeout_s=0).check(FIXED, T0 + 10**6) is None


def test_the_demand_is_the_bundle_ray_train_asks_for():
    cluster = ClusterConfig(accelerator_type="B200", cpus_per_worker=2.0)
    dog = StartupWatchdog.for_run(cluster, {"CPU": 2.0, "GPU": 1, "memory": 0}, 900)
    assert dog.demand == {"CPU": 2.0, "GPU": 1, "accelerator_type:B200": 0.001}
    assert dog.key == ("cluster.accelerator_type", "B200")
    plain = StartupWatchdog.for_run(ClusterConfig(), {"CPU": 1.0}, 900)
    assert plain.demand == {"CPU": 1.0} and plain.key == ("cluster.cpus_per_worker", 1.0)


# ---- what Ray publishes: v1 as recorded from the fake_multinode autoscaler (trimmed), v2 built ----

HEAD_ID = "f" * 51 + "00000"  # the fake provider's node ids, which are also its node "IPs"
NODE_ID = "f" * 51 + "00001"
NODES = [
    {"NodeID": HEAD_ID, "Alive": True, "NodeManagerAddress": "192.0.2.2", "Labels": {"ray.io/node-id": HEAD_ID},
     "Resources": {"object_store_memory": 6e9, "memory": 1.4e10, "node:__internal_head__": 1.0, "node:192.0.2.2": 1.0}},
    {"NodeID": NODE_ID, "Alive": True, "NodeManagerAddress": "192.0.2.2", "Labels": {"ray.io/node-id": NODE_ID},
     "Resources": {"GPU": 8.0, "CPU": 208.0, "accelerator_type:H100": 1.0, "memory": 1.2e10, "node:192.0.2.2": 1.0}},
]  # fmt: skip
GCP_H100 = {"CPU": 208.0, "GPU": 8.0, "accelerator_type:H100": 1.0}


def v1_status(launching: dict, pending_nodes: list, types: dict) -> dict:
    """autoscaler v1's ``__autoscaling_status`` as the fake cluster wrote it (load metrics trimmed)."""
    return {
        "load_metrics_report": {"pg_demand": [], "resource_demand": []},
        "autoscaler_report": {
            "active_nodes": {},
            "idle_nodes": None,
            "pending_nodes": pending_nodes,
            "pending_launches": launching,
            "failed_nodes": [],
            "node_type_mapping": types,
            "legacy": True,
        },
    }


def test_autoscaler_v1_status_and_events():
    head_only = {HEAD_ID: "ray.head.default"}
    growing = from_v1(v1_status({"gpu_h100_8x": 1}, [], head_only), [], NODES[:1], since=T0)
    assert growing.autoscaler and growing.launching == {"gpu_h100_8x": 1} and not growing.infeasible
    assert growing.nodes == {}  # the head offers nothing to a worker
    joining = from_v1(
        v1_status({}, [[NODE_ID, "gpu_h100_8x", "uninitialized"]], {**head_only, NODE_ID: "gpu_h100_8x"}),
        [],
        NODES,
        T0,
    )
    assert joining.launching == {"gpu_h100_8x": 1}
    assert joining.nodes == {"gpu_h100_8x": GCP_H100}  # named by the autoscaler's node -> type map
    event = {
        "time": str(datetime.fromtimestamp(int(T0) + 5)),  # as the dashboard lists it
        "message": "Error: No available node types can fulfill resource request {'GPU': 1.0, 'CPU': 8.0, "
        "'accelerator_type:B200': 0.001}. Add suitable node types to this cluster to resolve this issue.",
    }
    old = {**event, "time": str(datetime.fromtimestamp(int(T0) - 600))}
    status = v1_status({}, [], head_only)
    state = from_v1(status, [{"time": event["time"], "message": "Resized to 0 CPUs."}, old, event], NODES, T0)
    assert state.infeasible == ({"GPU": 1.0, "CPU": 8.0, "accelerator_type:B200": 0.001},)
    assert from_v1(status, [old], NODES, since=T0).infeasible == ()  # a verdict from long before
    with pytest.raises(InfeasibleDemand):
        watchdog({"CPU": 8, "GPU": 1, "accelerator_type:B200": 0.001}, timeout_s=0).check(state, T0 + 6)
    # `ray start` by hand: Ray's read-only provider names each node's type after its id.
    fixed = v1_status({}, [], {"192.0.2.2": f"node_{'a' * 56}"})
    assert from_v1(fixed, [event], NODES, since=T0) == FIXED


def test_autoscaler_v2_cluster_status():
    from ray.core.generated import autoscaler_pb2 as pb

    reply = pb.GetClusterStatusReply()
    st = reply.autoscaling_state
    st.pending_instance_requests.add(ray_node_type_name="gpu_h100_8x", count=1)
    st.pending_instances.add(ray_node_type_name="gpu_a100_8x")
    gang = st.infeasible_gang_resource_requests.add()
    for _ in range(2):
        gang.requests.add().resources_bundle.update(B200)
    reply.cluster_resource_state.node_states.add(ray_node_type_name="headgroup", node_id=bytes.fromhex(HEAD_ID))
    reply.cluster_resource_state.node_states.add(ray_node_type_name="gpu_h100_8x", node_id=bytes.fromhex(NODE_ID))
    state = from_v2(reply.SerializeToString(), NODES)
    assert state.autoscaler and state.launching == {"gpu_h100_8x": 1, "gpu_a100_8x": 1}
    assert state.nodes == {"gpu_h100_8x": GCP_H100}
    assert state.infeasible == (B200, B200)
    empty = pb.GetClusterStatusReply()
    empty.cluster_resource_state.node_states.add(ray_node_type_name=f"node_{'a' * 56}")
    assert from_v2(empty.SerializeToString(), NODES) == FIXED


# A refusal that comes after Ray has started (the autoscaler's verdict is one) reaches the terminal
# before Ray is torn down, and exactly once.
KILLED_IN_TEARDOWN = """
import os, signal, sys
import ray
from raytrain_hybrid import cli
from raytrain_hybrid.launch.runtime import autoscale, driver

def run(cfg, **kw):
    ray.is_initialized = lambda: True  # as after the driver joined its cluster
    raise autoscale.InfeasibleDemand("cluster.accelerator_type", "B200", "no node type holds one worker")

driver.run = run
ray.is_initialized = lambda: False
ray.shutdown = lambda: os.kill(os.getpid(), signal.SIGKILL)  # a driver killed on its way out
sys.exit(cli.main(["train", "--set", "data.path=memory", "--set", "run.output_dir=" + sys.argv[1]]))
"""


def test_a_refusal_after_ray_started_is_said_before_ray_is_torn_down(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", KILLED_IN_TEARDOWN, str(tmp_path / "run")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-2000:])
    said = "error: cluster.accelerator_type='B200': no node type holds one worker"
    assert said in done.stderr, done.stderr[-2000:]


def test_a_refusal_after_ray_started_is_said_once_and_exits_2(tmp_path, monkeypatch, capsys):
    import ray

    from raytrain_hybrid import cli
    from raytrain_hybrid.launch.runtime import driver

    torn_down = []

    def run(cfg, **kw):
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        raise InfeasibleDemand("cluster.accelerator_type", "B200", "no node type holds one worker")

    monkeypatch.setattr(driver, "run", run)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: torn_down.append(capsys.readouterr().err))
    out = tmp_path / "run"
    assert cli.main(["train", "--set", "data.path=memory", "--set", f"run.output_dir={out}"]) == 2
    (before_teardown,) = torn_down
    assert before_teardown.count("error: cluster.accelerator_type='B200': no node type holds one worker") == 1
    assert "error:" not in capsys.readouterr().err  # not said again after the teardown
    assert not (out / "driver.log").exists()  # a refused run leaves the directory as it was
