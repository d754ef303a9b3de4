"""Which Ray cluster a run joins, decided without joining it: the address the plan, the checks
and the driver all read (launch.runtime.session joins it)."""

from __future__ import annotations

import os

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.validate import RAY_ADDRESS_FORM
from raytrain_hybrid.errors import ConfigError

_ENV = "RAY_ADDRESS"


def ray_address(cfg: Config) -> str:
    """The cluster a run joins ("": a private local Ray); see join_address."""
    return join_address(cfg.cluster.address)


def join_address(explicit: str = "") -> str:
    """The one place that decides which Ray cluster a driver joins: ``explicit`` (--address,
    cluster.address), else $RAY_ADDRESS; "" (or an explicit "local") starts a private local Ray.

    A driver joins through the cluster's GCS address (host:6379, or "auto" on one of its nodes).
    The dashboard's job-server address (http://host:8265), which the cluster guides export as
    RAY_ADDRESS for `ray job submit`, cannot be joined: Ray 2.60's ray.init refuses any http(s)
    address, and Ray has no supported way to ask a dashboard for its GCS address. So it is refused
    here, before ray.init, with what to set instead. An explicit address wins over such a
    RAY_ADDRESS, which is then dropped from this process's environment (Ray's "auto" reads it)."""
    explicit, env = explicit.strip(), os.environ.get(_ENV, "").strip()
    if _is_http(explicit):
        raise ConfigError("--address (cluster.address)", explicit, _dashboard_fix(explicit))
    for key, value in (("--address (cluster.address)", explicit), (_ENV, env)):
        if value and not RAY_ADDRESS_FORM.fullmatch(value) and not _is_http(value):
            raise ConfigError(
                key,
                value,
                "is not a Ray address: give HOST:PORT (the head's GCS, e.g. 10.0.0.1:6379), auto, local "
                "or ray://HOST:PORT",
            )
    if explicit:
        if _is_http(env):
            del os.environ[_ENV]
        return "" if explicit == "local" else explicit
    if _is_http(env):
        raise ConfigError(_ENV, env, _dashboard_fix(env))
    return env


def _is_http(address: str) -> bool:
    return address.lower().startswith(("http://", "https://"))


def _dashboard_fix(address: str) -> str:
    return (
        "is the Ray dashboard's job-server address (for `ray job submit`); a driver joins a cluster at its GCS "
        "address instead. Run this command on that cluster as a job: `ray job submit --address "
        f"{address} --working-dir . -- raytrain-hybrid ...` (Ray sets RAY_ADDRESS inside the job); or, on one of "
        "its nodes, add --address auto (or --address HOST:6379, the head's GCS address); --address local starts a "
        "private local Ray. To keep the job-server address in this shell, export it as RAY_API_SERVER_ADDRESS "
        "(which `ray job submit` reads first) and unset RAY_ADDRESS"
    )
