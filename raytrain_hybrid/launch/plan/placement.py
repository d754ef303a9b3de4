"""What each worker asks of Ray, and where a placement would put the workers.

The prediction lets ``check`` draw the layout of a live cluster and lets ``train``
refuse a layout whose TP groups cannot stay inside a node before any worker
starts. It is a prediction: the workers check the nodes they actually got.
"""

from __future__ import annotations

from raytrain_hybrid.config import Config


def worker_resources(cfg: Config, use_gpu: bool) -> dict[str, float]:
    resources = {"CPU": cfg.cluster.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    return resources


def predict_workers_per_node(
    node_totals: list[dict[str, float]], world: int, per_worker: dict[str, float], strategy: str
) -> list[int] | None:
    """Workers per node for a fresh placement group, or None when the nodes cannot hold it
    now (an autoscaling cluster may still add nodes, so that is not an error here)."""
    caps = [min(int(total.get(k, 0) // v) for k, v in per_worker.items() if v > 0) for total in node_totals]
    if strategy == "STRICT_SPREAD":
        caps = [min(c, 1) for c in caps]
    if sum(caps) < world:
        return None
    counts = [0] * len(caps)
    left = world
    if strategy in ("PACK", "STRICT_PACK"):
        # As few nodes as possible: the largest first.
        for i in sorted(range(len(caps)), key=lambda i: -caps[i]):
            take = min(caps[i], left)
            counts[i], left = take, left - take
    else:  # SPREAD, STRICT_SPREAD: round robin over nodes with room
        while left:
            for i in range(len(caps)):
                if left and counts[i] < caps[i]:
                    counts[i] += 1
                    left -= 1
    return [c for c in counts if c]


def live_node_totals() -> list[dict[str, float]]:
    import ray

    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]
