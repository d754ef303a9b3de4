"""Joining or starting the Ray cluster a run uses, and what its workers run with."""

from __future__ import annotations

import math
import os

from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError

_TRAIN_V2 = "RAY_TRAIN_V2_ENABLED"


def use_train_v2() -> None:
    """Ray Train V2, on which the launcher is built: the default of Ray 2.60, so nothing is set
    (Ray Train hands a variable set on the driver to every worker as a runtime env, and a worker
    with a runtime env starts through a second Python process: ~0.5 s of CPU each). A user who
    turned it off is told, before ray.train is imported."""
    if os.environ.get(_TRAIN_V2, "1").strip().lower() in ("0", "false", "no", "off"):
        raise ConfigError(
            _TRAIN_V2,
            os.environ[_TRAIN_V2],
            "selects Ray Train V1; raytrain_hybrid runs on Ray Train V2 (Ray's "
            "default): unset the variable or set it to 1",
        )


def ensure_ray(cfg: Config, world_size: int) -> None:
    import ray

    if ray.is_initialized():
        return
    # No runtime env of ours: the workers need no variable of this package's (a runtime env
    # would also start each worker process twice, see use_train_v2).
    address = ray_address(cfg)
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # No cluster: a private local one with enough logical CPUs for every worker
    # (plus one for Ray Train's controller), however few cores the machine has.
    need = math.ceil(world_size * cfg.cluster.cpus_per_worker) + 1
    ray.init(
        address="local",
        num_cpus=max(need, os.cpu_count() or 1),
        log_to_driver=False,
        include_dashboard=False,
    )


def ray_address(cfg: Config) -> str:
    """The cluster to join ("": a private local Ray)."""
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")


def resolve_use_gpu(cfg: Config, world_size: int, nodes: list[dict[str, float]]) -> bool:
    """cluster.use_gpu, or when unset, whether ``nodes`` (those the cluster may reach: an autoscaler's
    GPU nodes may not be up yet) have a GPU for every worker."""
    if cfg.cluster.use_gpu is not None:
        return cfg.cluster.use_gpu
    return sum(n.get("GPU", 0) for n in nodes) >= world_size
