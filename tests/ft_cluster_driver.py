"""A fault-tolerant run on a simulated cluster (ray.cluster_utils.Cluster), its faults, one JSON line.

Used by test_replicas_ray.py in a subprocess (the test session has a Ray of its own):

    python tests/ft_cluster_driver.py '{"out": DIR, "sets": [...], "faults": {"node": 2, "lighthouse": 6, "both": 10}}'

A head with no CPUs (the drivers, Ray Train's controllers and the Lighthouse actor live there,
as on a real cluster) and two nodes of 2 CPUs, one replica group on each. One `train --address`
starts both groups and the Lighthouse. Once group 0 has trained the step a fault names:

- "node": the node holding group 1's workers is removed and a fresh node joins;
- "lighthouse": the Lighthouse actor's process is killed (SIGKILL);
- "both": one worker of each group is killed at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ray
from ray._private import state
from ray.cluster_utils import Cluster


def steps_done(run: Path, group: int) -> int:
    metrics = run / f"replica_{group}" / "metrics.jsonl"
    try:
        return sum('"loss"' in line for line in metrics.read_text().splitlines())
    except OSError:
        return 0


def live(class_name: str) -> list[dict]:
    """The live actors of a class (Ray's state without its dashboard, which this cluster has not)."""
    return [
        a for a in state.actors().values() if a["ActorClassName"].endswith(class_name) and a["State"] in ("ALIVE", 2)
    ]


def workers_of(group_driver_pid: int) -> list[dict]:
    """The live Ray Train workers of the group whose driver has this pid."""
    jobs = {j["JobID"] for j in state.jobs() if j.get("DriverPid") == group_driver_pid}
    return [a for a in live("RayTrainWorker") if a["JobID"] in jobs]


def group_drivers(parent: int) -> dict[int, int]:
    """replica group -> pid of its `train` (a child of the launch's)."""
    import psutil

    found = {}
    for child in psutil.Process(parent).children():
        for arg in child.cmdline():
            if arg.startswith("fault_tolerance.replica_group="):
                found[int(arg.split("=")[1])] = child.pid
    return found


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {}
    for _ in range(2):
        node = cluster.add_node(num_cpus=2, wait=False)
        nodes[node.node_id] = node
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    cli = str(Path(sys.executable).parent / "raytrain-hybrid")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    sets = [a for s in spec["sets"] for a in ("--set", s)]
    proc = subprocess.Popen(
        [cli, "train", "--address", cluster.address, *sets],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    faults, t0 = [], time.time()
    try:
        for fault, at in sorted(spec["faults"].items(), key=lambda kv: kv[1]):
            while steps_done(out, 0) < at and proc.poll() is None and time.time() - t0 < 400:
                time.sleep(0.05)
            if proc.poll() is not None:
                break
            drivers = group_drivers(proc.pid)
            record = {"fault": fault, "group0_steps": steps_done(out, 0), "t": round(time.time() - t0, 1)}
            if fault == "node":
                where = {a["Address"]["NodeID"] for a in workers_of(drivers[1])}
                record["removed"] = len(where)
                for node_id in where:
                    cluster.remove_node(nodes.pop(node_id))
                node = cluster.add_node(num_cpus=2)
                nodes[node.node_id] = node
            elif fault == "lighthouse":
                pids = [a["Pid"] for a in live("LighthouseServerActor")]
                record["killed"] = pids
                os.kill(pids[0], signal.SIGKILL)
            else:
                victims = [workers_of(drivers[g])[-1]["Pid"] for g in (0, 1)]
                record["killed"] = victims
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
            faults.append(record)
        stdout, _ = proc.communicate(timeout=max(60, 480 - (time.time() - t0)))
    finally:
        proc.kill()
    result = {"returncode": proc.returncode, "stdout": stdout, "faults": faults, "seconds": round(time.time() - t0, 1)}
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
