"""`check`'s start plan: the plan `train`'s driver would make (launch.runtime.start.derive_plan, the same
derivation and the same start line), made without starting anything.

Nothing is written: no output directory is made, no lease taken, no Ray snapshot removed, no
input prepared. The nodes are those `--topology` gives (workers per node), else the cluster
`--address` or RAY_ADDRESS names (joined to read it), else the one node of the private local Ray
`train` would start. run.output_dir's lease is read, never taken; ``--resume`` is checked by the
driver's own check (launch.runtime.start.prepare_run_dir), so `check` refuses what `train` would. Storage
that cannot be read here (no network, no credentials) is said as "not verified", at once: an
object store is read without the retries a run makes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json

import pyarrow.fs as pafs

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic
from raytrain_hybrid.errors import ConfigError, storage_reason
from raytrain_hybrid.launch.plan.address import ray_address
from raytrain_hybrid.launch.plan.autolayout import pick_for_check
from raytrain_hybrid.launch.plan.preflight import _check_output_dir
from raytrain_hybrid.launch.plan.reach import Reach
from raytrain_hybrid.launch.plan.run_plan import DataSource
from raytrain_hybrid.launch.records.lease import LEASE, describe, expired, in_use
from raytrain_hybrid.launch.records.tracking import check_tracking
from raytrain_hybrid.launch.runtime.session import live_workers_per_node, use_train_v2
from raytrain_hybrid.launch.runtime.start import (
    ResumePoint,
    RunPlan,
    check_before_ray,
    derive_plan,
    prepare_run_dir,
    run_nodes,
)
from raytrain_hybrid.models.hub import Unreadable
from raytrain_hybrid.storage import Store, is_uri, open_store

_CONNECT_S, _REQUEST_S = 5.0, 20.0  # an object store out of reach answers nothing: give up soon
# GCS's client bounds its retries by time; offline its credential look-up (the metadata server's
# name not resolving) retried for 9-12 s under a 5 s limit, about 1 s under this one. A reachable
# bucket answers its first try: the limit stops retries, not a request in flight.
_GCS_RETRY_S = 1.0


def check_layout(cfg: Config, topology: list[int] | None, say=print) -> tuple[Config, list[int], Reach | None]:
    """`check`'s layout and workers per node: layout=auto's pick for ``topology``'s nodes or the
    named cluster's (said), else the configured layout on ``topology``, on the named cluster as a
    placement would put it (with the nodes its autoscaler may add), or on one node holding all."""
    if cfg.parallelism.layout == "auto":
        reach = None
        if not topology and ray_address(cfg):
            reach = run_nodes(cfg, topology)  # read once: the pick and the start plan share it
        return (*pick_for_check(cfg, topology, say, reach), reach)
    world = cfg.parallelism.world_size
    if not topology:
        return cfg, live_workers_per_node(cfg, world, say), None
    if sum(topology) != world:
        raise ConfigError(
            "--topology", ",".join(map(str, topology)), f"places {sum(topology)} workers; the layout needs {world}"
        )
    return cfg, topology, None


def check_plan(
    cfg: Config,
    asked: Config,
    topology: list[int] | None,
    resume: str | None,
    allow_change: list[str],
    unverified: list[str],
    say=print,
    reach: Reach | None = None,
) -> RunPlan:
    """The start plan of ``cfg`` (the config at the layout check shows; ``asked``: as given, which an
    elastic run keeps) on ``topology``'s nodes, the named cluster's (``reach``: as check_layout read
    it), or this machine's. ConfigError
    where `train` would refuse the resume or the output directory's checkpoints; what cannot be
    read here is appended to ``unverified``."""
    cfg = asked if is_elastic(asked.parallelism) else cfg  # an elastic run's workers pick at each start
    check_tracking(cfg)  # the driver's first checks, in its order
    use_train_v2()
    store = None
    try:
        store = open_store(cfg.run.output_dir)
        lease = lease_state(quick(store))
    except (OSError, ConfigError) as exc:
        # Opening an s3:// URI without an endpoint asks AWS for the bucket's region: offline or
        # without credentials that fails as an OSError, which check says instead of refusing.
        if isinstance(exc, ConfigError) and not isinstance(exc.__cause__, OSError):
            raise
        reason = storage_reason(exc.__cause__ if isinstance(exc, ConfigError) else exc)
        uri = store.uri if store is not None else cfg.run.output_dir.rstrip("/")
        what = "its lease, its checkpoints and --resume are" if resume else "its lease and its checkpoints are"
        unverified.append(f"run.output_dir={uri!r} could not be read here ({reason}); {what} not checked")
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=uri))
        store = None
        point, lease = ResumePoint(None, [], {}), "not checked (run.output_dir could not be read here)"
    else:
        cfg, point = prepare_run_dir(cfg, resume, allow_change, say, reader=quick)
    cfg, data = _inputs(cfg, say, unverified)
    placement = topology if topology else None
    reach = reach or run_nodes(cfg, topology)
    plan = derive_plan(
        cfg,
        point,
        reach,
        None,
        say,
        data=data,
        placement=placement,
        checked=False,
        lease=lease,
        unverified=unverified,
        asked=asked,
    )
    try:  # the one check of the live nodes that reads nothing: said, not refused (--topology may be nodes to come)
        if store is not None:  # an output it could not open is said above, as not verified
            _check_output_dir(cfg, reach.live, plan.resources)
    except ConfigError as exc:
        say(f"warning: train refuses this on these nodes: {exc}")
    return plan


def _inputs(cfg: Config, say, unverified: list[str]) -> tuple[Config, DataSource | None]:
    """`train`'s checks before Ray starts (launch.runtime.start.check_before_ray), refusing what it refuses;
    a data set or model in storage out of reach here is said as not verified (no DataSource)."""
    try:
        cfg, data = check_before_ray(cfg, say)
    except (OSError, ConfigError) as exc:
        where = str(exc.value) if isinstance(exc, ConfigError) else ""
        remote = is_uri(where) and not where.startswith("file://")
        # A model's files out of reach here (models.hub.Unreadable) may well exist: said, not refused.
        if isinstance(exc, ConfigError) and not (
            isinstance(exc.__cause__, OSError) and remote or isinstance(exc, Unreadable)
        ):
            raise
        unverified.append(f"{exc} (the input's checks could not be made here)")
        return cfg, None
    if not data.checked and not data.shipped:  # the shipped corpus, prepared when train first starts
        unverified.append(f"data.path={cfg.data.path!r}: its rows are encoded and checked by train, on the cluster")
    return cfg, data


def lease_state(out: Store) -> str:
    """run.output_dir's lease (launch.records.lease), read and never taken: free, else the ConfigError
    `train` gives when another run holds it."""
    lease = out.child(LEASE)
    if not lease.is_file():
        return "free"
    try:
        body = json.loads(lease.read_text())
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    if expired(body):
        return f"free (the lease of a run that is gone has expired: {describe(body)})"
    raise in_use(out.uri, body)


def quick(store: Store) -> Store:
    """``store`` opened to give up at once where it is out of reach: one try, short timeouts (a run's
    own reads retry for seconds)."""
    fs = store.fs
    try:
        if isinstance(fs, pafs.S3FileSystem):
            rebuild, (kwargs,) = fs.__reduce__()
            fs = rebuild(
                {
                    **kwargs,
                    "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1),
                    "connect_timeout": kwargs["connect_timeout"] if kwargs["connect_timeout"] > 0 else _CONNECT_S,
                    "request_timeout": kwargs["request_timeout"] if kwargs["request_timeout"] > 0 else _REQUEST_S,
                }
            )
        elif isinstance(fs, pafs.GcsFileSystem):
            rebuild, (kwargs,) = fs.__reduce__()
            fs = rebuild({**kwargs, "retry_time_limit": datetime.timedelta(seconds=_GCS_RETRY_S)})
    except (TypeError, ValueError, KeyError):  # another pyarrow's pickling: its own retries, then
        return store
    return dataclasses.replace(store, fs=fs)
