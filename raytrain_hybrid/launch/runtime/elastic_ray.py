"""Ray Train V2's elastic policy, restricted to the worker counts of usable layouts (see
launch.plan.elastic). Imported only after launch.runtime.session.use_train_v2, by launch.runtime.driver.

Ray has no public hook for a scaling policy: ``TorchTrainer.fit`` builds one from the
ScalingConfig. So this subclasses Ray's ``ElasticScalingPolicy`` (only its worker count
changes) and ``TorchTrainer.fit`` (the same controller, given this policy). Both lean on
Ray Train V2 internals of Ray 2.60; an upgrade that moves them fails here, at the first
elastic run, not with a wrong mesh.
"""

from __future__ import annotations

import ray
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import create_failure_policy
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2._internal.util import ObjectRefWrapper, time_monotonic

from raytrain_hybrid.launch.plan.elastic import workers_that_fit


class ReplicaScalingPolicy(ElasticScalingPolicy):
    """Starts and resizes only to ``counts`` (whole replicas at a usable dp), TP groups inside
    a node; reads the cluster fresh at each look, and again once the group has stopped."""

    def __init__(self, scaling_config, *, counts: list[int], tp: int) -> None:
        super().__init__(scaling_config)
        self.counts, self.tp = list(counts), tp
        self._was_running = False
        self._deciding_for_running = False

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self._was_running = True
        self._deciding_for_running = True
        try:
            return super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        finally:
            self._deciding_for_running = False

    def make_decision_for_non_running_worker_group(self):
        if self._was_running:  # the group just failed (a node lost?): not the view from before
            self._was_running = False
            self._latest_reserved_resources_query_time = float("-inf")
        return super().make_decision_for_non_running_worker_group()

    def _count_possible_workers(self, reserved_resources) -> int:
        """Nodes being drained (a preemption notice) are leaving: Ray's view still counts them,
        and a group restarted at the deadline would wait for them, then time out. A running
        group counts them still: else Ray's look for a resize (every few seconds) would shrink
        it at once, before its ranks heard the notice and saved (seen on the simulated cluster:
        the steps since the last periodic checkpoint lost, the restart counted as a resize)."""
        per_worker = self.scaling_config._resources_per_worker_not_none
        leaving = set() if self._deciding_for_running else _draining_nodes()
        staying = [r for node, r in reserved_resources.items() if node not in leaving]
        return workers_that_fit(staying, per_worker, self.tp, self.counts)

    def _get_reserved_resources(self):
        """As Ray's, with the coordinator's view of the nodes recomputed: it refreshes its node
        list every 20 s by itself, so a restart right after a node died would ask for a
        placement group that still counts the dead node, and wait for it to time out."""
        now = time_monotonic()
        if now - self._latest_reserved_resources_query_time < self.GET_RESERVED_RESOURCES_INTERVAL_S:
            return self._latest_reserved_resources
        reserved = None
        try:
            reserved = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
            )
        except Exception:  # as Ray's: no decision this time, the next look tries again
            reserved = None
        self._latest_reserved_resources_query_time = time_monotonic()
        self._latest_reserved_resources = reserved
        return reserved


def _draining_nodes() -> set[str]:
    """Ids of the nodes Ray Core is draining (what Ray Train's preemption watcher reads)."""
    try:
        return set(ray._private.state.state.get_draining_nodes() or {})
    except Exception:  # as a failed look at the cluster: count every node, the next look tries again
        return set()


class ReplicaTorchTrainer(TorchTrainer):
    """TorchTrainer whose controller runs ReplicaScalingPolicy (DataParallelTrainer.fit,
    with that policy in place of the one Ray would build)."""

    def __init__(self, *, counts: list[int], tp: int, **kwargs) -> None:
        self._replica_counts, self._tp = list(counts), tp
        super().__init__(**kwargs)

    def fit(self):
        if self.running_in_local_mode:
            return super().fit()
        result = self._initialize_and_run_controller(
            train_fn_ref=ObjectRefWrapper(self._get_train_func()),
            scaling_policy=ReplicaScalingPolicy(self.scaling_config, counts=self._replica_counts, tp=self._tp),
            failure_policy=create_failure_policy(self.run_config.failure_config),
            train_run_context=self.train_run_context,
            callbacks=self._create_default_callbacks(),
            validation_config=self.validation_config,
        )
        if result.error:
            raise result.error
        return result
