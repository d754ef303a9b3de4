"""The ``[fault_tolerance]`` section: per-step fault tolerance over the replica groups (torchft).

A replica group is one whole copy of the model: the shard x cp x tp x pp workers of one
``dp_replicate`` index (every dp rank under zero=0; one of ``parallelism.replicate`` groups under
zero=2/3). The groups meet in a quorum at every step; a group that fails drops out and the others
go on; the group, restarted, receives the state from a live peer. Checks across keys are
:func:`check_fault_tolerance`'s."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

from raytrain_hybrid.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class FaultToleranceConfig:
    # Per-step fault tolerance on the replica axis (torchft): the replica groups average their
    # gradients in a quorum that is formed again at every step, so a group that fails drops out
    # and the others go on without a restart; the failed group, restarted, joins a later quorum
    # and receives the weights, optimizer state and step from a live group.
    enabled: bool = False
    # The fewest replica groups a step may commit with; below it the step waits for groups to
    # (re)join, and the run fails after fault_tolerance.quorum_timeout_s.
    min_replicas: int = 1
    # Seconds a step waits for a quorum of at least min_replicas groups (a group that restarts
    # takes its start-up time to join; give it more than that).
    quorum_timeout_s: float = 120.0
    # Seconds a cross-group collective (the gradients' average, the commit vote, a state
    # transfer to a rejoining group) may take before the step is given up and retried.
    step_timeout_s: float = 60.0
    # Under torchrun, each replica group is its own launch: which group this launch is
    # (0 .. groups-1). Under Ray the trainer numbers the groups; -1: not set.
    replica_group: int = -1
    # The torchft Lighthouse (host:port or http://host:port) the groups meet at; "" reads the
    # TORCHFT_LIGHTHOUSE environment variable (`raytrain-hybrid lighthouse` starts one).
    lighthouse: str = ""

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError("fault_tolerance.min_replicas", self.min_replicas, "must be >= 1")
        for key in ("quorum_timeout_s", "step_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"fault_tolerance.{key}", getattr(self, key), "must be > 0 seconds")
        if self.replica_group < -1:
            raise ConfigError("fault_tolerance.replica_group", self.replica_group, "must be >= 0 (or -1: not set)")


def replica_groups(par) -> int:
    """How many whole model copies the layout holds: the dp_replicate degree (dp under zero=0,
    parallelism.replicate under a ZeRO stage that shards)."""
    return par.dp if par.zero == 0 else par.replicate


def check_fault_tolerance(cfg) -> None:
    """[fault_tolerance] across keys: at least two replica groups, a data-parallel stage whose
    gradients are whole after the backward, and torchft installed."""
    ft, par = cfg.fault_tolerance, cfg.parallelism
    if not ft.enabled:  # its keys mean nothing without it: set, they are refused rather than ignored
        default = FaultToleranceConfig()
        for f in dataclasses.fields(ft):
            if getattr(ft, f.name) != getattr(default, f.name):
                raise ConfigError(
                    f"fault_tolerance.{f.name}",
                    getattr(ft, f.name),
                    "is read only with fault_tolerance.enabled=true; set that too, or leave this key out",
                )
        return
    groups = replica_groups(par)
    if groups < 2:
        raise ConfigError(
            "fault_tolerance.enabled",
            True,
            f"needs at least two replica groups, and dp={par.dp} zero={par.zero} replicate={par.replicate} makes "
            f"{groups}; raise parallelism.dp (zero=0: every dp rank is a group) or set parallelism.replicate >= 2",
        )
    if par.zero == 1:
        raise ConfigError(
            "fault_tolerance.enabled",
            True,
            "is not combined with parallelism.zero=1 (ZeRO-1 reduces the gradients inside its optimizer step); "
            "use zero=0, or zero=2/3 with parallelism.replicate",
        )
    if ft.min_replicas > groups:
        raise ConfigError(
            "fault_tolerance.min_replicas", ft.min_replicas, f"is more than the layout's {groups} replica groups"
        )
    for key, value, bad in (
        ("parallelism.layout", par.layout, par.layout == "auto"),
        ("parallelism.min_dp", par.min_dp, bool(par.min_dp)),
        ("parallelism.ep", par.ep, par.ep > 1),
    ):
        if bad:
            raise ConfigError(
                key,
                value,
                "is not combined with fault_tolerance.enabled (the replica groups are fixed; a lost group "
                "comes back instead of the layout changing); give a fixed layout, or fault_tolerance.enabled=false",
            )
    if ft.replica_group >= groups:
        raise ConfigError(
            "fault_tolerance.replica_group", ft.replica_group, f"must be below the layout's {groups} replica groups"
        )
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "fault_tolerance.enabled",
            True,
            "needs torchft, which is not installed here: pip install 'torchft>=0.2' (or the project's [ft] extra)",
        )
