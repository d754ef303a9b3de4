"""Fixtures that run a cluster of their own start with the session, in a thread beside the tests.

The autoscaling simulation (three `ray start` heads with their autoscalers), the two-node
topology run (a ray.cluster_utils.Cluster in a subprocess) and the submitted jobs (a `ray start`
head) share nothing with the session's Ray or its other tests, and hand their tests plain data.
Run in turn, each spent much of its minutes waiting (on Ray's start-up, autoscaler rounds, a
node's loss being noticed) while the machine had CPU to spare, and the gloo and Ray tests around
them spent theirs waiting on other things. Started when the session's tests are collected (after
the session's own Ray, see conftest.py), they run side by side with the rest of the suite; their
tests, last in the order, wait for the result (or start the work then, alone).

A module takes part by defining ``background(workdir: Path, env: dict, cases: set | None) -> data``;
conftest.py names those modules (BACKGROUND) and the one each waits for first, so that at most one
cluster of this kind runs beside the tests at a time. A module whose tests read parts of its work
marks each with ``@pytest.mark.needs("case", ...)``: a selection of its tests (``-k``, node ids)
then runs only the cases they read; ``cases`` is None (all) when a selected test has no mark.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="background")
_JOBS: dict[str, Future] = {}
_CASES: dict[str, set[str] | None] = {}  # per job, the cases it runs (None: all)
_STOPS: list[Callable[[], None]] = []  # what ends a job's processes early (a session cut short)
_GATES: dict[str, threading.Event] = {}  # per job, open once it may start (see start's ``gated``)
_ENDING = threading.Event()  # the session is ending: a job still held at its gate does not start
_ROOT = Path(tempfile.mkdtemp(prefix="rt-background-"))


def start(
    name: str, fn: Callable[..., object], after: str | None = None, cases: set[str] | None = None, gated: bool = False
) -> None:
    """Run ``fn(its own work dir, the environment now, cases)`` in the background, once ``after``'s
    job (if started) has ended, and with ``gated`` once ``open_gate(name)`` is called too (by its
    result, at the latest) or the machine idles (_open_when_idle). The environment is taken now,
    before any test changes it; ``cases`` are those the selected tests need (their ``needs``
    marks), None for all."""
    env = dict(os.environ)
    before = _JOBS.get(after) if after else None
    _CASES[name] = cases
    gate = _GATES[name] = threading.Event()
    if gated:
        _open_when_idle(gate, before)
    else:
        gate.set()

    def job():
        gate.wait()
        if _ENDING.is_set():
            return None  # the session ended before the job was due: nothing started
        if before is not None:
            before.exception()  # wait; its own test reports its failure
        workdir = _ROOT / name
        workdir.mkdir()
        return fn(workdir, env, cases)

    _JOBS[name] = _POOL.submit(job)


def _open_when_idle(gate: threading.Event, before: Future | None, share: float = 0.25, every: float = 3.0) -> None:
    """Open a held job's ``gate`` also when the job it waits for (``before``) has ended and the
    machine's CPU was at least ``share`` idle over each of two looks ``every`` seconds apart: the
    tests then wait on something (Ray's start-ups, a restart) and the job fills the cores they
    leave. A fixed trigger module alone opened it minutes after the other clusters were done,
    and fresh-clone runs showed 25-45 % idle for tens of seconds in between."""

    def idle_share() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    def watch() -> None:
        last, idle_looks = idle_share(), 0
        while not gate.wait(every) and not _ENDING.is_set():
            now = idle_share()
            total = now[1] - last[1]
            idle_looks = idle_looks + 1 if total and (now[0] - last[0]) / total >= share else 0
            last = now
            if idle_looks >= 2 and (before is None or before.done()):
                gate.set()

    threading.Thread(target=watch, name="gate-watch", daemon=True).start()


def cases(name: str) -> set[str] | None:
    """The cases the job ``name`` runs (or will, when started by ``result``): None for all."""
    return _CASES.get(name)


def open_gate(name: str) -> None:
    """Let the gated job ``name`` start (once ``after``'s has ended)."""
    if name in _GATES:
        _GATES[name].set()


def result(name: str, fn: Callable[..., object]):
    """The background job's result (waiting for it), or ``fn`` run now when none was started
    (the module was not selected at collection, e.g. run by node id)."""
    if name not in _JOBS:
        start(name, fn)
    open_gate(name)
    return _JOBS[name].result()


def on_stop(stop: Callable[[], None]) -> None:
    """Register how to end a job's processes if the session ends before its tests took the result
    (-x, a keyboard interrupt, a run of other tests)."""
    _STOPS.append(stop)


def finish() -> None:
    """At the session's end: end what still runs, wait for it, drop the work dirs."""
    _ENDING.set()
    for gate in _GATES.values():
        gate.set()  # a job still held there returns at once
    if not all(job.done() for job in _JOBS.values()):
        for stop in _STOPS:
            stop()
    _POOL.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(_ROOT, ignore_errors=True)
