"""One `train` for every replica group of a fault-tolerant run on Ray, and their Lighthouse.

`train` with fault_tolerance.enabled on Ray and no fault_tolerance.replica_group starts:

- the torchft Lighthouse as a Ray actor (Ray Train's own LighthouseServerActor) on this driver's
  node, at a fixed port and with max_restarts: a Lighthouse process that dies is started again by
  Ray at the same address, and the groups' next quorum finds it there;
- each replica group as a `train` of its own (a child process with fault_tolerance.replica_group
  set, joined to the same cluster), so that Ray Train restarts the worker group of the group that
  failed and no other (run.max_failures each). Ray Train 2.60's TorchftConfig restarts replica
  groups of one worker only, so it cannot restart a tp/pp/cp or shard group alone.

The children's lines reach the terminal prefixed with their group; each keeps its records in
run.output_dir/replica_<g>. The run succeeded when at least one group trained every step (its
checkpoints and final weights are the run's); a group that spent its restarts is named.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.fault_tolerance import replica_groups
from raytrain_hybrid.errors import ConfigError, redact

# How long the Lighthouse waits for a group that is up but has not asked to join a quorum, and
# after how long a silent group is out: `raytrain-hybrid lighthouse`'s defaults.
JOIN_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 60.0, 5.0


@dataclasses.dataclass(frozen=True)
class Source:
    """What `train` was given, for the groups' own launches: the config file and --set overrides."""

    config: str | None
    overrides: tuple[str, ...]


def describe(cfg: Config) -> str:
    """The line `check` and `train` print for a launch of every group."""
    from raytrain_hybrid.engine.replicas import named_lighthouse

    par, ft = cfg.parallelism, cfg.fault_tolerance
    groups = replica_groups(par)
    named = named_lighthouse(cfg)
    where = f"the Lighthouse at {named}" if named else "a Lighthouse started as a Ray actor on this driver's node"
    return (
        f"fault tolerance: {groups} replica groups of {par.world_size // groups} workers, each a Ray Train run "
        f"restarted alone (run.max_failures={cfg.run.max_failures}), meeting at {where}; at least "
        f"{ft.min_replicas} group(s) a step; records in {cfg.run.output_dir}/replica_<g>"
    )


def group_resume(resume: str | None, group: int) -> str | None:
    """--resume of a launch of every group: the run directory of that launch, whose group g
    continues from replica_<g>; a group's own directory or checkpoint is for a launch of that group."""
    if resume is None:
        return None
    from raytrain_hybrid.storage import open_store

    store = open_store(resume, "--resume")
    mine = store.child(f"replica_{group}")
    if not mine.is_dir():
        raise ConfigError(
            "--resume",
            resume,
            f"has no replica_{group}/: give the run.output_dir of a fault-tolerant run (its groups' records are "
            "in replica_<g>/), or resume one group with --set fault_tolerance.replica_group=<g>",
        )
    return mine.uri


def train_groups(cfg: Config, source: Source, resume: str | None, verbose: bool, allow_change) -> int:
    """Start the Lighthouse (unless one is named) and every replica group; wait for them. Ray's
    own output goes to run.output_dir/driver.log unless ``verbose``, as for any run."""
    import ray

    from raytrain_hybrid.launch.records.progress import quiet_driver
    from raytrain_hybrid.launch.records.rundir import mirror_dir
    from raytrain_hybrid.launch.runtime.driver import sigterm_ends_the_run

    groups = replica_groups(cfg.parallelism)
    resumes = [group_resume(resume, g) for g in range(groups)]  # refused before Ray starts
    connected_before = ray.is_initialized()
    log = mirror_dir(cfg.run.output_dir) / "driver.log"
    children: list[subprocess.Popen] = []
    with quiet_driver(log, quiet=not verbose) as (out, err, _live):
        print(describe(cfg), file=out, flush=True)
        try:
            with sigterm_ends_the_run():
                codes = _run_groups(cfg, source, resumes, verbose, allow_change, children, out)
        except KeyboardInterrupt as exc:
            return _stop(cfg, children, exc, err)
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
            if ray.is_initialized() and not connected_before:
                ray.shutdown()
        return _outcome(cfg, codes, out, err)


def _run_groups(cfg, source, resumes, verbose, allow_change, children, out) -> list[int]:
    import ray

    from raytrain_hybrid.launch.runtime.session import ensure_ray

    groups = len(resumes)
    # Every group's workers and its Ray Train controller on a private local Ray.
    ensure_ray(cfg, cfg.parallelism.world_size + groups - 1)
    from raytrain_hybrid.engine.replicas import named_lighthouse

    lighthouse = named_lighthouse(cfg)
    if not lighthouse:
        _actor, lighthouse = _start_lighthouse(cfg)
        print(f"lighthouse: {lighthouse} (a Ray actor; Ray restarts it at this address)", file=out, flush=True)
    address = ray.get_runtime_context().gcs_address
    for g in range(groups):
        command = _group_command(source, g, lighthouse, address, resumes[g], verbose, allow_change)
        children.append(_spawn(command, g, out))
    return [child.wait() for child in children]


def _stop(cfg: Config, children: list[subprocess.Popen], exc: KeyboardInterrupt, err) -> int:
    """Ctrl-C or SIGTERM: each group is told the same, and given a minute to write its records."""
    from raytrain_hybrid.launch.runtime.driver import Terminated

    how = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    for child in children:
        if child.poll() is None:
            child.send_signal(how)
    for child in children:
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
    said = "terminated (SIGTERM)" if how == signal.SIGTERM else "interrupted (Ctrl-C)"
    _write_summary(cfg, [child.returncode for child in children], said)
    print(f"{said}: every group stopped; what they wrote is in {cfg.run.output_dir}", file=err, flush=True)
    return 143 if how == signal.SIGTERM else 130


def _start_lighthouse(cfg: Config):
    """Ray Train's Lighthouse actor on this node at a port of its own, restarted by Ray at the same
    address when its process dies (the port is bound again; the groups keep its address)."""
    import ray
    from ray.train.v2.torch.torchft_config import LighthouseServerActor
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with socket.socket() as probe:  # a free port now, kept across the actor's restarts
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    ft = cfg.fault_tolerance
    kwargs = {
        "bind": f"[::]:{port}",
        "min_replicas": ft.min_replicas,
        "join_timeout_ms": int(JOIN_TIMEOUT_S * 1000),
        "heartbeat_timeout_ms": int(HEARTBEAT_TIMEOUT_S * 1000),
    }
    here = ray.get_runtime_context().get_node_id()
    actor = LighthouseServerActor.options(
        num_cpus=0,  # a head node offers no CPUs to tasks, as clusters are usually set up
        max_restarts=-1,
        max_task_retries=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True),
    ).remote(lighthouse_kwargs=kwargs)
    return actor, ray.get(actor.address.remote(), timeout=120)


def _group_command(source: Source, group, lighthouse, address, resume, verbose, allow_change) -> list[str]:
    sets = [
        *source.overrides,
        f"fault_tolerance.replica_group={group}",
        f"fault_tolerance.lighthouse={lighthouse}",
        f"cluster.address={address}",
    ]
    command = [sys.executable, "-m", "raytrain_hybrid.cli", "train", *([source.config] if source.config else [])]
    command += [a for s in sets for a in ("--set", s)]
    command += ["--resume", resume] if resume else []
    command += [a for key in allow_change or () for a in ("--allow-change", key)]
    return command + (["--verbose"] if verbose else [])


# Looked up here, not between fork and exec, where loading a library could wait on a lock that
# another of this process's threads (Ray's) held at the fork.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # in the child, before exec: a group outlives no driver (kill -9 included)
    PR_SET_PDEATHSIG = 1
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(command: list[str], group: int, out) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # cluster.address names it
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        preexec_fn=_die_with_parent if _PRCTL is not None else None,
    )

    def relay() -> None:
        for line in child.stdout:
            print(f"[group {group}] {line.rstrip()}", file=out, flush=True)

    threading.Thread(target=relay, daemon=True, name=f"group-{group}-lines").start()
    return child


def _write_summary(cfg: Config, codes: list[int | None], ended: str | None = None) -> list[dict]:
    """The launch's summary.json (each group's own is in replica_<g>/); returns its groups' rows."""
    from raytrain_hybrid.storage import open_store

    top = open_store(cfg.run.output_dir)
    rows = []
    for g, code in enumerate(codes):
        row = {"replica_group": g, "exit_code": code, "output_dir": top.child(f"replica_{g}").uri}
        own = top.child(f"replica_{g}", "summary.json")
        if own.is_file():
            try:
                summary = json.loads(own.read_text())
                row |= {k: summary.get(k) for k in ("ended", "steps", "final_loss")}
            except (ValueError, OSError):
                pass
        rows.append(row)
    done = [r for r in rows if r["exit_code"] == 0]
    summary = {"ended": ended or ("completed" if done else "failed"), "replica_groups": rows}
    if done:
        summary |= {"steps": done[0].get("steps"), "final_loss": done[0].get("final_loss")}
    top.makedirs()
    top.child("summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return rows


def _outcome(cfg: Config, codes: list[int], out, err) -> int:
    """The launch's summary.json, one line, the exit code."""
    time.sleep(0.2)  # the relays' last lines first
    if all(code == 2 for code in codes):
        return 2  # each refused, and said why
    rows = _write_summary(cfg, codes)
    done = [r for r in rows if r["exit_code"] == 0]
    lost = [r for r in rows if r["exit_code"] != 0]
    for r in lost:
        said = f"warning: replica group {r['replica_group']} ended with exit code {r['exit_code']}"
        print(redact(f"{said}; its records: {r['output_dir']}"), file=err)
    if not done:
        print(f"error: no replica group finished; their records are in {cfg.run.output_dir}", file=err)
        return 1
    kept = ", ".join(str(r["replica_group"]) for r in done)
    print(f"done: replica group(s) {kept} trained every step -> {cfg.run.output_dir}", file=out, flush=True)
    return 0
