"""[fault_tolerance]'s meeting point: the torchft Lighthouse (`raytrain-hybrid lighthouse`), and how
a fault-tolerant run is launched.

Each replica group is a torchrun launch of its own (TorchTitan's way): torchrun restarts the group's
processes when one of them fails (--max-restarts), while the other groups go on. Ray Train 2.60's
torchft support restarts replica groups of one worker only, so a group of several workers (tp, pp,
cp or a shard group inside it) cannot be restarted alone there; such runs go through torchrun.
"""

from __future__ import annotations

import socket
import sys
import time

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.fault_tolerance import replica_groups
from raytrain_hybrid.errors import ConfigError


def group_commands(cfg: Config, config_path: str = "CONFIG") -> list[str]:
    """The torchrun command of each replica group (each its own launch, restarted alone)."""
    groups = replica_groups(cfg.parallelism)
    size = cfg.parallelism.world_size // groups
    return [
        f"torchrun --standalone --nproc-per-node {size} --max-restarts 3 -m raytrain_hybrid.cli train {config_path} "
        f"--set fault_tolerance.replica_group={g}"
        for g in range(groups)
    ]


def refuse_on_ray(cfg: Config) -> None:
    groups = replica_groups(cfg.parallelism)
    raise ConfigError(
        "fault_tolerance.enabled",
        True,
        f"runs each of the {groups} replica groups as a torchrun launch of its own, not on Ray (Ray Train restarts "
        "whole worker groups); start a Lighthouse (raytrain-hybrid lighthouse), set TORCHFT_LIGHTHOUSE, then per "
        "group: " + group_commands(cfg)[0].replace("replica_group=0", "replica_group=<g>"),
    )


def serve(port: int, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float) -> int:
    """Run a Lighthouse until Ctrl-C or SIGTERM; prints its address first."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        raise ConfigError("lighthouse", "", "needs torchft: pip install 'torchft>=0.2'") from exc
    from raytrain_hybrid.launch.driver import sigterm_ends_the_run

    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    bound = server.address().rsplit(":", 1)[-1]
    address = f"http://{socket.gethostname()}:{bound}"
    print(f"lighthouse: {address} (a step needs {min_replicas} replica group(s) or more)", flush=True)
    print(f"export TORCHFT_LIGHTHOUSE={address}", flush=True)
    try:
        with sigterm_ends_the_run():
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("lighthouse stopped", file=sys.stderr)
        return 0
    finally:
        server.shutdown()
