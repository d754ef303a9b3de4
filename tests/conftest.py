"""One local Ray cluster per test session (starting Ray and torch workers costs tens of seconds)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Data reads made in this process (the references' batches, the stream tests) would start
# Ray's default of 32 Parquet footer-reader actors, a Python process each, per dataset
# execution (about 20 s of a 2-core machine each time). The launcher gives its workers 1 per 64
# files (launch/plan/inputs.py reader_env) and no test dataset has more; set before Ray starts, so the
# session's cluster and the subprocesses the tests start (CLI runs, jobs, notebooks) read alike.
os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
# Ray Train's controller polls its workers every 2 s: a run's end (and a dead worker) is seen up
# to 2 s late, in each of the suite's ~20 runs. Its preemption watcher, an actor process per
# worker group, watches for cloud nodes being drained, which only the topology test's elastic run
# does (it turns the watcher on for its CLI: Ray Train hands the driver's setting to its
# controller). Both reach every Ray the suite starts (the session's, CLI runs', `ray start`
# heads') through this environment.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# One torch thread in this process and those it starts, set before torch is first imported. The
# single-process references (tests/reference.py) run here, often beside Ray workers and gloo
# ranks; with torch's default of a thread per core, each tiny op's parallel region spins its
# OpenMP threads on a machine with no core to spare: the 60-step reference of the topology test's
# elastic run took 36 s of CPU (2 min of wall) on 2 threads and 3 s on 1. Ray's workers and the
# gloo ranks set their own count (launch/runtime/entry.py, tests/gloo_harness.py) as before.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late
    sys.modules["torch"].set_num_threads(1)
# Every Ray the suite starts (~25: the session's, `ray start` heads, simulated nodes, CLI runs)
# would cost CPU this 2-core machine lacks, for nothing a test looks at:
# - the raylet starts a worker process per CPU when the first driver connects, for that job's
#   runtime env; Ray Train's controller and workers carry their own env vars (another runtime
#   env), so they cannot use them, and 51 such processes idled through a suite run (~140 s
#   of CPU, ~2.8 s each to import Ray twice). Workers start when a task or actor needs them.
# - the log monitor lists the session's log directory every 0.1 s while it holds fewer than
#   1,000 files (55 s of CPU over a suite run); at most every 5 s here.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")

RAY_CPUS = 12


def _compile_sources() -> None:
    """The package's and the tests' bytecode, written once per session. The package is installed
    editable (scripts/setup.sh compiles only what it installs into .venv), and with
    PYTHONDONTWRITEBYTECODE set, as in CI, no process writes it: each of the suite's few hundred
    processes that import the package (Ray Train workers, CLI runs, gloo ranks, Ray Data tasks)
    compiled its ~80 modules again, ~0.1 s of CPU each (~0.2 s on a loaded machine). compileall
    writes whatever that variable says and skips files whose bytecode is current; Python checks a
    file's bytecode against its source's mtime and size, so an edited file is compiled afresh."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for tree in (root / "raytrain_hybrid", root / "tests"):
        compileall.compile_dir(tree, quiet=2)


_compile_sources()


ASSETS = Path(__file__).resolve().parent / "assets"


def job_overrides(path) -> list[str]:
    """The --set a test adds to a jobs/ config whose checkpoint is in a bucket no test reaches
    (model.pretrained = s3://.../NAME): model.pretrained=tests/assets/NAME, the published
    config.json of that model, which is all resolving, checking and planning the job read.
    Without it the job's `check` runs too, saying it could not read the checkpoint
    (tests/test_hub.py); its planner line needs the model's sizes."""
    import tomllib

    from job_files import submit_overrides

    # The placeholders (<your-bucket>) filled in on the header's submit line, as a user submits it.
    sets = submit_overrides(path)
    pretrained = tomllib.loads(Path(path).read_text()).get("model", {}).get("pretrained", "")
    if "://" not in pretrained:
        return sets
    copy = ASSETS / pretrained.rstrip("/").rsplit("/", 1)[-1]
    assert (copy / "config.json").is_file(), f"{path}: tests/assets has no copy of the config.json of {pretrained}"
    return [*sets, f"model.pretrained={copy}"]


def load_job(path, overrides=()):
    """A jobs/ config as a test loads it: job_overrides, then ``overrides``."""
    from raytrain_hybrid.config import load_config

    return load_config(path, [*job_overrides(path), *overrides])


# Modules whose fixture runs a cluster of its own (tests/background.py): it starts when the
# session's tests are collected and runs beside them, each after the one named (one such cluster
# beside the tests at a time); their tests run last, when the result is most likely there.
BACKGROUND = {
    "test_autoscaling_sim": None,
    "test_topology_ray": "test_autoscaling_sim",
    "test_jobs_ray": "test_topology_ray",
    # The README's quick start as pasted (its own local Ray, 8 workers): last, in the cores the
    # single-process modules at the end of a run leave.
    "test_quick_start": "test_jobs_ray",
    # Fault tolerance on a cluster of its own: a node, the Lighthouse and two workers lost.
    "test_replicas_ray": "test_quick_start",
}
# Background modules held back until the main thread reaches a module (when that module is
# selected): the submitted jobs' head (~160 s of CPU, much of it drivers waiting) started with
# the others kept both cores busy while the Ray tests ran first, and was over long before the
# modules after test_cli_ray, where single-process tests (config, CLI usage, the docs' build,
# the house checks) left one core idle for about two minutes of the run. It also starts as soon
# as the machine idles once the cluster before it is done (tests/background.py).
HELD_UNTIL = {"test_jobs_ray": "test_cli_usage"}


# Modules that leave a core idle run first, while the background clusters' work fills the CPU
# they leave: those whose tests mostly wait on Ray (CLI runs one after the other: Ray Train's
# start, Ray Data, Tune; a killed worker's restart) and those that work in one process (the
# compiled single-rank case compiling, the pretrained references). Last in file order they ran
# alone, with the machine 20-50 % idle (~75 s of CPU unused at the end of a run). The gloo cases,
# which keep both cores busy, are then the ones that finish the session. After them the small
# modules that mostly wait (on `check` giving up on an unreachable bucket, a killed driver, a
# subprocess): measured per test in a whole run, 35-95 % idle while they ran near the end, after
# the background clusters had finished (about 40 s of a core).
FIRST = (
    "test_storage_ray", "test_sweep_ray", "test_recovery_ray", "test_reach_kuberay", "test_speed", "test_pretrained",
    "test_hub", "test_faults", "test_gpu_scripts", "test_fuzz", "test_lease", "test_examples", "test_tracking",
    "test_storage", "test_planner", "test_pretrained_range", "test_resume_range", "test_start_plan",
)  # fmt: skip


def pytest_collection_modifyitems(items):
    def order(item) -> tuple[bool, int]:
        name = getattr(item.module, "__name__", "")
        return name in BACKGROUND, FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=order)  # stable: the rest keep their order


def pytest_collection_finish(session):
    import background

    if session.config.option.collectonly:  # nothing runs: start no cluster
        return
    modules = {item.module.__name__: item.module for item in session.items if getattr(item, "module", None)}
    if any(name in modules for name in BACKGROUND) and any("ray_local" in item.fixturenames for item in session.items):
        # The session's Ray first: its raylet must register within 30 s (Ray's fixed wait), which
        # a loaded machine (three autoscaling heads starting) may not give it.
        start_session_ray()
    # Ray imported here first, on the main thread: background jobs and the tests importing it at
    # once from their threads found half-initialised modules ("partially initialized module
    # 'ray._private.services'") when no session cluster had imported it before them.
    import ray  # noqa: F401

    for name, after in BACKGROUND.items():
        if name in modules:
            selected = [item for item in session.items if getattr(item, "module", None) is modules[name]]
            gated = HELD_UNTIL.get(name) in modules
            background.start(name, modules[name].background, after, needed_cases(selected), gated=gated)


def pytest_runtest_setup(item):
    import background

    module = getattr(item.module, "__name__", "") if getattr(item, "module", None) else ""
    for name, trigger in HELD_UNTIL.items():
        if module == trigger:
            background.open_gate(name)


def needed_cases(items) -> set[str] | None:
    """The background cases the selected tests read (their `needs` marks), so that `pytest -k` or a
    node id runs only those; None (every case) if one of them says nothing."""
    cases: set[str] = set()
    for item in items:
        marks = list(item.iter_markers("needs"))
        if not marks:
            return None
        cases.update(arg for mark in marks for arg in mark.args)
    return cases


def pytest_sessionfinish(session):
    import background

    background.finish()


def start_session_ray():
    import ray

    if ray.is_initialized():
        return
    # The session's S3 endpoint and keys in the environment every node and worker of this
    # cluster starts with, as a cloud cluster's nodes have theirs (instance roles): the CLI
    # runs writing to the bucket join this cluster instead of starting a Ray of their own.
    from s3_server import session_env

    os.environ.update(session_env())
    import psutil

    from raytrain_hybrid.launch.runtime.session import left_by_a_failed_start

    for attempt in (1, 2):
        before = {p.pid for p in psutil.Process().children()}
        try:
            ray.init(
                address="local",
                num_cpus=RAY_CPUS + 4,  # 9 + 5 workers of the CLI tests side by side, Ray Data read tasks, a Tune trial
                include_dashboard=False,
                log_to_driver=False,  # no runtime env: each worker would start as two Python processes
            )
            return
        except Exception as exc:  # Ray waits 30 s for its raylet; on a loaded machine, once more
            ray.shutdown()
            # What the failed start left running (its GCS, dashboard, monitors: ray.init drops the
            # node that holds them, and they idled beside the second start for the whole session).
            for proc in left_by_a_failed_start(before):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise


@pytest.fixture(scope="session")
def ray_local():
    import ray

    start_session_ray()
    yield ray
    ray.shutdown()


@functools.lru_cache(maxsize=8)
def reference_history(overrides: tuple[str, ...], source: str = "memory"):
    """The single-process reference. source="ray": on the Ray Data input the launcher feeds
    (needs the session's Ray); "memory": on the in-memory windows of the engine without Ray."""
    import torch
    from reference import ray_data_batches, reference_run

    from raytrain_hybrid.config import load_config

    torch.manual_seed(0)
    cfg = load_config(None, list(overrides))
    windows = ray_data_batches(cfg, cfg.train.steps) if source == "ray" else None
    return reference_run(cfg, windows)
