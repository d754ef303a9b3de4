"""A fault-tolerant run on a simulated cluster (ray.cluster_utils.Cluster), its faults, one JSON line.

Used by test_replicas_ray.py in a subprocess (the test session has a Ray of its own):

    python tests/ft_cluster_driver.py '{"out": URI, "sets": [...], "faults": {"node": 2, "lighthouse": 6, "both": 10}}'

A head with no CPUs (the drivers, Ray Train's controllers and the Lighthouse actor live there,
as on a real cluster) and two nodes of 2 CPUs, one replica group on each. One `train --address`
starts both groups and the Lighthouse; their records go to ``out`` (object storage). Once the
launch has printed that group 0 trained the step a fault names:

- "node": the node holding group 1's workers is removed and a fresh node joins;
- "lighthouse": the Lighthouse actor's process is killed (SIGKILL);
- "both": one worker of each group is killed at once;
- "head": the head node is lost (the launch's driver killed, the cluster shut down, the
  Lighthouse with it); on a new cluster the run is submitted again with --resume.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from ray._private import state
from ray.cluster_utils import Cluster


class Lines:
    """The launch's terminal, read as it is printed: `[group g] step N/...` says how far g is."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def steps_done(self, group: int) -> int:
        found = (re.match(rf"\[group {group}\] step (\d+)/", line) for line in list(self.lines))
        return max((int(m.group(1)) for m in found if m), default=0)


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


def start_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {}
    for _ in range(2):
        node = cluster.add_node(num_cpus=2, wait=False)
        nodes[node.node_id] = node
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, nodes


def main() -> None:
    from raytrain_hybrid.storage import open_store

    spec = json.loads(sys.argv[1])
    cluster, nodes = start_cluster()
    cli = str(Path(sys.executable).parent / "raytrain-hybrid")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    sets = [a for s in spec["sets"] for a in ("--set", s)]

    def launch(*more: str):
        proc = subprocess.Popen(
            [cli, "train", "--address", cluster.address, *sets, *more],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        return proc, Lines(proc.stdout)

    proc, seen = launch()
    earlier = []  # the lines of a launch the head's loss ended
    faults, t0 = [], time.time()
    try:
        for fault, at in sorted(spec["faults"].items(), key=lambda kv: kv[1]):
            while seen.steps_done(0) < at and proc.poll() is None and time.time() - t0 < 400:
                time.sleep(0.05)
            if proc.poll() is not None:
                break
            drivers = group_drivers(proc.pid)
            record = {"fault": fault, "group0_steps": seen.steps_done(0), "t": round(time.time() - t0, 1)}
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
            elif fault == "both":
                victims = [workers_of(drivers[g])[-1]["Pid"] for g in (0, 1)]
                record["killed"] = victims
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
            else:  # "head": the driver's node, and with it the Lighthouse, Ray's head and the cluster
                os.kill(proc.pid, signal.SIGKILL)
                ray.shutdown()
                cluster.shutdown()
                proc.wait(60)
                time.sleep(0.5)
                earlier += seen.lines
                record["returncode"] = proc.returncode
                run = open_store(spec["out"])  # what the lost launch left on storage, per group: its steps
                for g in (0, 1):
                    metrics = run.child(f"replica_{g}", "metrics.jsonl")
                    lines = metrics.read_text().splitlines() if metrics.exists() else []
                    record[f"steps_{g}"] = [json.loads(line).get("step") for line in lines if '"loss"' in line]
                cluster, nodes = start_cluster()  # a new cluster; the run submitted again
                proc, seen = launch("--resume", spec["out"])
            faults.append(record)
        try:  # (a whole run took 330 s up to the head's loss on a machine 2x slower than usual)
            proc.wait(timeout=max(300, 1300 - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            print("".join(seen.lines)[-4000:], file=sys.stderr)  # what the launch said before it stalled
            raise
    finally:
        proc.kill()
    time.sleep(0.5)  # the reader's last lines
    result = {"returncode": proc.returncode, "stdout": "".join(seen.lines), "faults": faults}
    result["earlier"] = "".join(earlier)
    result["seconds"] = round(time.time() - t0, 1)
    # The records, from the output URI (the nodes' disks hold none of them).
    run = open_store(spec["out"])
    for g in (0, 1):
        own = run.child(f"replica_{g}")
        result[f"metrics_{g}"] = [json.loads(line) for line in own.child("metrics.jsonl").read_text().splitlines()]
        result[f"summary_{g}"] = json.loads(own.child("summary.json").read_text())
    result["summary"] = json.loads(run.child("summary.json").read_text())
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
