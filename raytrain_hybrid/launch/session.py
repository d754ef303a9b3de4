"""Joining or starting the Ray cluster a run uses, and what its workers run with."""

from __future__ import annotations

import json
import math
import os

from raytrain_hybrid.config import Config

_TRAIN_V2 = "RAY_TRAIN_V2_ENABLED"
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", _TRAIN_V2: "1"}


def use_train_v2() -> None:
    """Ray Train V2 (the default in Ray 2.60) on the driver, as on the workers. ray.train picks
    its version when it is first imported: call this before that (a user's own setting wins)."""
    os.environ.setdefault(_TRAIN_V2, "1")


def _runtime_env() -> dict:
    """Our worker variables, less those a submitted job's runtime env already sets: Ray
    refuses to merge a job's and a driver's runtime env that name the same variable."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}")
    taken = (job.get("runtime_env") or {}).get("env_vars") or {}
    return {"env_vars": {k: v for k, v in _WORKER_ENV.items() if k not in taken}}


def ensure_ray(cfg: Config, world_size: int) -> None:
    import ray

    if ray.is_initialized():
        return
    env = _runtime_env()
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
        return
    # No cluster: a private local one with enough logical CPUs for every worker
    # (plus one for Ray Train's controller), however few cores the machine has.
    need = math.ceil(world_size * cfg.cluster.cpus_per_worker) + 1
    ray.init(
        address="local",
        num_cpus=max(need, os.cpu_count() or 1),
        runtime_env=env,
        log_to_driver=False,
        include_dashboard=False,
    )


def resolve_use_gpu(cfg: Config, world_size: int) -> bool:
    import ray

    if cfg.cluster.use_gpu is not None:
        return cfg.cluster.use_gpu
    return ray.cluster_resources().get("GPU", 0) >= world_size
