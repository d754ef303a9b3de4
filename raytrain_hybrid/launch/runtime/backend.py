"""The process group Ray Train makes for a run, with what run.hang_timeout_s asks of NCCL.

Ray Train creates each worker's default process group before the training function runs, and
torch reads its NCCL flight-recorder variables when a process group is made: so they are set on
every worker by the backend itself, just before ``init_process_group`` (not as a runtime env,
which would start every worker process twice). Ray Train's own NCCL hang detector is switched on
on the driver, where the trainer reads its variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from raytrain_hybrid.config import Config
from raytrain_hybrid.engine.hang import nccl_env, ray_hang_detector_env, set_env


@dataclass
class RunTorchConfig(TorchConfig):
    """TorchConfig whose backend sets ``worker_env`` on every worker before the process group."""

    worker_env: dict[str, str] = field(default_factory=dict)

    @property
    def backend_cls(self):
        return _RunTorchBackend


class _RunTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: RunTorchConfig) -> None:
        if backend_config.worker_env:
            worker_group.execute(set_env, backend_config.worker_env)
        super().on_start(worker_group, backend_config)


def torch_config(cfg: Config, backend: str) -> TorchConfig:
    """The run's TorchConfig; on an NCCL run with run.hang_timeout_s, Ray Train's hang detector on
    in this (the driver's) process, unless the user set its variables."""
    if "nccl" not in backend or not cfg.run.hang_timeout_s:
        return TorchConfig(backend=backend)
    for key, value in ray_hang_detector_env(cfg, backend).items():
        os.environ.setdefault(key, value)
    return RunTorchConfig(backend=backend, worker_env=nccl_env(cfg))
