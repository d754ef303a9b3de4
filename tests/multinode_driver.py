"""Run layouts on a simulated multi-node Ray cluster; print one JSON line of results.

Used by test_topology_ray.py in a subprocess: a process joins one Ray cluster, and the
rest of the test session shares a single-node one. Virtual nodes of
ray.cluster_utils.Cluster share one IP, so ranks are grouped by node id.

    python tests/multinode_driver.py '{"nodes": [4, 4], "tmp_root": DIR, "cases": {"name": CASE}}'

A CASE is a list of "key=value" overrides, or {"overrides": [...], "lose_node_after": "checkpoints/step_2"}:
then a spare node joins first, and once that checkpoint of run.output_dir is complete (its
manifest is there) one node holding training workers is removed, and its disk with it. With
"tmp_root", every worker node gets its own TMPDIR under it (its "local disk"), and the result
lists what each one holds after the cases.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from raytrain_hybrid.config import load_config
from raytrain_hybrid.launch.driver import run
from raytrain_hybrid.storage import open_store


class Nodes:
    """The cluster's worker nodes, named node0, node1, ... in the order they joined."""

    def __init__(self, cluster: Cluster, tmp_root: str | None) -> None:
        self.cluster, self.tmp_root = cluster, Path(tmp_root) if tmp_root else None
        self.names: dict[str, str] = {}  # node id -> name
        self.alive: dict[str, object] = {}  # name -> ray's Node
        self.gpus: dict[str, int] = {}

    def add(self, gpus: int, wait: bool = True):
        name = f"node{len(self.names)}"
        extra = {}
        if self.tmp_root is not None:  # what a worker there writes to "local disk" lands in its own folder
            (self.tmp_root / name).mkdir(parents=True)
            extra["env_vars"] = {"TMPDIR": str(self.tmp_root / name)}
        node = self.cluster.add_node(wait=wait, num_cpus=gpus, num_gpus=gpus, **extra)
        self.names[node.node_id], self.alive[name], self.gpus[name] = name, node, gpus
        return node

    def remove_one_with_workers(self) -> dict:
        """Remove a node whose GPUs training workers hold (never the driver's head), and its disk."""
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
        busy = [n for n, node in self.alive.items() if free.get(node.node_id, {}).get("GPU", 0) < self.gpus[n]]
        if not busy:
            return {"removed": None, "busy_before": busy}
        name = busy[-1]
        self.cluster.remove_node(self.alive.pop(name))
        if self.tmp_root is not None:
            shutil.rmtree(self.tmp_root / name)
        return {"removed": name, "busy_before": busy, "removed_at": time.time()}

    def disks(self) -> dict[str, list[str]]:
        """Per live node, the files under its TMPDIR (relative paths)."""
        if self.tmp_root is None:
            return {}
        return {
            n: sorted(str(p.relative_to(self.tmp_root / n)) for p in (self.tmp_root / n).rglob("*")) for n in self.alive
        }


def lose_node_when_complete(nodes: Nodes, manifest, done: threading.Event, report: dict) -> None:
    """Wait for ``manifest`` (a checkpoint complete on storage), then remove a node with workers."""
    while not done.is_set():
        if manifest.exists():
            report.update(nodes.remove_one_with_workers())
            return
        time.sleep(0.1)


def run_case(nodes: Nodes, spec: dict, name: str, case, tmp: str) -> dict:
    case = case if isinstance(case, dict) else {"overrides": case}
    cfg = load_config(
        None,
        [
            "cluster.use_gpu=true",
            "cluster.backend=gloo",  # fake GPUs: CUDA is absent, workers fall back to the CPU
            f"run.output_dir={Path(tmp) / name}",
            "run.shared_fs=true",  # the simulated nodes share this machine's disk
            "run.progress=false",
            *case["overrides"],  # last: a case may override the keys above
        ],
    )
    out = open_store(cfg.run.output_dir)
    loss: dict = {}
    done = threading.Event()
    if "lose_node_after" in case:
        nodes.add(spec["nodes"][0])  # the spare the restarted worker group will need
        marker = out.child(*case["lose_node_after"].split("/"), "manifest.json")
        watcher = threading.Thread(target=lose_node_when_complete, args=(nodes, marker, done, loss), daemon=True)
        watcher.start()
    try:
        summary = run(cfg)
    except Exception as exc:  # reported to the test, which decides
        return {"error": str(exc), **loss}
    finally:
        done.set()
    history = [json.loads(line) for line in out.child("metrics.jsonl").read_text().splitlines()]
    per_rank = [{**r, "node": nodes.names.get(r["node"], r["node"])} for r in summary["per_rank"]]
    result = {"history": history, "per_rank": per_rank, **loss}
    if "lose_node_after" in case:
        result["summary"] = json.loads(out.child("summary.json").read_text())
        result["summary_returned"] = json.loads(json.dumps({k: v for k, v in summary.items() if k != "per_rank"}))
        result["checkpoints"] = out.child("checkpoints").listdir()
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    # The head holds no worker slots (Ray Train's controller needs no CPU), nor a dashboard
    # (nothing here reads it); each virtual node has fake GPUs, so placement follows GPU
    # slots as on a real cluster.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    nodes = Nodes(cluster, spec.get("tmp_root"))
    for gpus in spec["nodes"]:  # the nodes start side by side, then one wait for them all
        nodes.add(gpus, wait=False)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in spec["cases"].items():
            t0 = time.time()
            results[name] = {**run_case(nodes, spec, name, case, tmp), "seconds": round(time.time() - t0, 1)}
    results["disks"] = nodes.disks()
    results["cwd"] = sorted(os.listdir("."))
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
