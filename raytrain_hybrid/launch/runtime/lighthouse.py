"""[fault_tolerance]'s launches: each replica group a launch of its own, and the torchft Lighthouse
they meet at (`raytrain-hybrid lighthouse`).

A replica group is started like a run of its own, so that what restarts a run restarts that
group alone while the others go on (TorchTitan's way): one `torchrun` launch per group
(torchrun --max-restarts restarts it), or one `train` per group on a Ray cluster (Ray Train
restarts its worker group, run.max_failures). Each keeps its records under
run.output_dir/replica_<g>. Ray Train 2.60's own torchft support (TorchftConfig) restarts
replica groups of one worker only, so a group of several workers (tp, pp, cp or a shard group)
could not be restarted alone there.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
import time

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.fault_tolerance import replica_groups
from raytrain_hybrid.errors import ConfigError


def group_launch(cfg: Config, world: int | None, how: str, restart: int = 0, every: bool = False) -> Config:
    """This launch's replica group: checked, and its records in run.output_dir/replica_<g>
    (replica_<g>_restart<n> after torchrun restarted it). ``world``: the processes torchrun
    started (None on Ray, which starts the group's workers itself); ``how``: the launcher's way
    to set the process count, for the messages. ``every``: a Ray launch of every group
    (launch.runtime.ft_groups), checked here as its group 0, which needs no Lighthouse named."""
    from raytrain_hybrid.engine.replicas import lighthouse_address

    ft, par = cfg.fault_tolerance, cfg.parallelism
    groups = replica_groups(par)
    size = par.world_size // groups
    if ft.replica_group < 0 and every:
        cfg = dataclasses.replace(cfg, fault_tolerance=dataclasses.replace(ft, replica_group=0))
        return _in(cfg, 0)
    if ft.replica_group < 0:
        raise ConfigError(
            "fault_tolerance.replica_group",
            ft.replica_group,
            f"is not set: each of the {groups} replica groups is a launch of its own ({size} workers each), "
            f"restarted alone when it fails; start a Lighthouse (raytrain-hybrid lighthouse), then each group "
            f"with --set fault_tolerance.replica_group=<0..{groups - 1}>"
            + ("" if how else "; on Ray, `raytrain-hybrid train` without it starts every group and their Lighthouse"),
        )
    lighthouse_address(cfg)  # refused here, before anything is built, when none is named
    if world is not None and size != world:
        raise ConfigError(
            "parallelism",
            f"dp={par.dp} cp={par.cp} tp={par.tp} pp={par.pp}",
            f"makes replica groups of {size} ranks ({groups} groups), but {world} were started: run each group "
            f"with {how} {size}",
        )
    return _in(cfg, ft.replica_group, restart)


def _in(cfg: Config, group: int, restart: int = 0) -> Config:
    from raytrain_hybrid.storage import open_store

    name = f"replica_{group}" + (f"_restart{restart}" if restart else "")
    out = open_store(cfg.run.output_dir).child(name).uri
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=out))


def serve(port: int, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float) -> int:
    """Run a Lighthouse until Ctrl-C or SIGTERM; prints its address first."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        raise ConfigError("lighthouse", "", "needs torchft: pip install 'torchft>=0.2'") from exc
    from raytrain_hybrid.launch.runtime.driver import sigterm_ends_the_run

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
    # Ctrl-C stops it even where its launcher left SIGINT ignored (a shell's background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigterm_ends_the_run():
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("lighthouse stopped", file=sys.stderr)
        return 0
    finally:
        server.shutdown()
