"""Run layouts on a simulated multi-node Ray cluster; print one JSON line of results.

Used by test_topology_ray.py in a subprocess: a process joins one Ray cluster, and the
rest of the test session shares a single-node one. Virtual nodes of
ray.cluster_utils.Cluster share one IP, so ranks are grouped by node id.

    python tests/multinode_driver.py '{"nodes": [4, 4], "cases": {"name": ["key=value", ...]}}'
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from raytrain_hybrid.config import load_config
from raytrain_hybrid.launch.driver import run


def main() -> None:
    spec = json.loads(sys.argv[1])
    # The head holds no worker slots (Ray Train's controller needs no CPU), nor a dashboard
    # (nothing here reads it); each virtual node has fake GPUs, so placement follows GPU
    # slots as on a real cluster.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    for gpus in spec["nodes"]:  # the nodes start side by side, then one wait for them all
        cluster.add_node(wait=False, num_cpus=gpus, num_gpus=gpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    node_of_id = {n["NodeID"]: f"node{i}" for i, n in enumerate(ray.nodes()) if n["Resources"].get("GPU")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in spec["cases"].items():
            out = Path(tmp) / name
            cfg = load_config(
                None,
                [
                    "cluster.use_gpu=true",
                    "cluster.backend=gloo",  # fake GPUs: CUDA is absent, workers fall back to the CPU
                    f"run.output_dir={out}",
                    "run.shared_fs=true",  # the simulated nodes share this machine's disk
                    "run.progress=false",
                    *overrides,  # last: a case may override the keys above
                ],
            )
            try:
                summary = run(cfg)
            except Exception as exc:  # reported to the test, which decides
                results[name] = {"error": str(exc)}
                continue
            history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            per_rank = [{**r, "node": node_of_id.get(r["node"], r["node"])} for r in summary["per_rank"]]
            results[name] = {"history": history, "per_rank": per_rank}
    ray.shutdown()
    cluster.shutdown()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
