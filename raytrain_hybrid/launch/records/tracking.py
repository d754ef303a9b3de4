"""run.tracking: a run's config, per-step metrics, checkpoints and summary in MLflow or Weights &
Biases (optional extras: ``pip install 'raytrain-hybrid[mlflow]'`` or ``[wandb]``).

Who does what, and why:

- The driver checks the package before Ray starts and opens the tracker run before any worker
  starts (with MLflow a wrong URI or an unreachable server fails the command there, not a worker
  later; W&B's driver only names the run, rank 0's ``wandb.init`` creates it), with the config
  as params, and ends the run after ``fit()``: with the summary and FINISHED, or FAILED (KILLED
  on Ctrl-C). It owns the run's lifetime because it outlives worker-group restarts: every
  restarted rank 0 logs into the same tracker run.
- Rank 0 logs each step's metrics as the step ends, and each checkpoint (:class:`StepLogger`):
  no ``ray.train.report`` barrier per step. A tracker that fails mid-run costs a warning in the
  worker's log, not the run; metrics.jsonl stays the record.
- Settings and credentials are the tracker's standard environment variables (MLFLOW_TRACKING_URI,
  MLFLOW_EXPERIMENT_NAME, ...; WANDB_PROJECT, WANDB_API_KEY, WANDB_MODE, ...). The driver's reach
  rank 0 through Ray's object store (an ObjectRef in train_loop_config), never by value: Ray
  Train keeps train_loop_config in its run state (the dashboard), and no credential may end up in
  anything the run keeps. Nothing here writes them to a file.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError, redact
from raytrain_hybrid.storage import private_dir

log = logging.getLogger(__name__)

# The environment variables each tracker reads: the driver's are handed to rank 0.
_ENV_PREFIXES = {"mlflow": ("MLFLOW_",), "wandb": ("WANDB_",)}


@dataclass(frozen=True)
class TrackerRun:
    """What rank 0 needs to log into the driver's tracker run (picklable, no credentials)."""

    backend: str  # run.tracking
    run_id: str
    config: dict  # the run's config (Config.to_dict()), for W&B's run config
    env: Any = None  # ObjectRef of the driver's tracker variables (see the module docstring)


def check_tracking(cfg: Config) -> None:
    """Before Ray starts: the chosen tracker's package is installed here (the driver logs too)."""
    name = cfg.run.tracking
    if name and importlib.util.find_spec(name) is None:
        raise ConfigError(
            "run.tracking",
            name,
            f"needs the {name} package, which is not installed here: pip install 'raytrain-hybrid[{name}]' "
            "(on the driver's node and every worker node: rank 0 logs the steps), or leave run.tracking empty",
        )


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"parallelism": {"dp": 2}} -> {"parallelism.dp": 2}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numbers(values: dict) -> dict[str, float]:
    """The numeric scalars of a metrics dict, as floats (None and strings are not metrics); a list
    of numbers (a mixture of experts' expert_load) is one metric per entry, ``key/<index>``."""
    out = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and k != "step"}
    for k, v in values.items():
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(v)})
    return out


def run_name(cfg: Config) -> str:
    par = cfg.parallelism
    return f"{cfg.model.arch} dp{par.dp}-tp{par.tp}-pp{par.pp}"


class _Mlflow:
    """MLflow through MlflowClient: the tracking URI, experiment and credentials from MLFLOW_* ."""

    def __init__(self) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient()  # reads MLFLOW_TRACKING_URI (and its credentials) now
        self.run_id = ""

    def _experiment_id(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's "Default" experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def create(self, cfg: Config) -> str:
        from mlflow.entities import Param

        tags = {"raytrain_hybrid.output_dir": cfg.run.output_dir}
        run = self.client.create_run(self._experiment_id(), run_name=run_name(cfg), tags=tags)
        # redact: a config is refused with credentials in a URI at load; a config built otherwise is not.
        params = [Param(k, redact(str(v))) for k, v in flatten(cfg.to_dict()).items()]
        self.client.log_batch(run.info.run_id, params=params)  # split into requests by MLflow
        return run.info.run_id

    def attach(self, handle: TrackerRun) -> None:
        self.run_id = handle.run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        # Asynchronous: the step does not wait for the tracking server; detach() flushes.
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value, synchronous=False)

    def detach(self, ok: bool) -> None:
        import mlflow

        mlflow.flush_async_logging()  # the driver ends the run (a restarted rank 0 continues it)

    def end(self, handle: TrackerRun, summary: dict | None, status: str) -> None:
        from mlflow.entities import Metric

        if summary:
            now, step = int(time.time() * 1000), summary.get("steps") or 0
            metrics = [Metric(f"summary.{k}", v, now, step) for k, v in numbers(_flat_summary(summary)).items()]
            self.client.log_batch(handle.run_id, metrics=metrics)
        self.client.set_terminated(handle.run_id, status)


class _Wandb:
    """Weights & Biases: project, key and mode from WANDB_* (WANDB_MODE=offline needs no server)."""

    def __init__(self) -> None:
        import wandb

        self.wandb = wandb
        self.run = None

    def create(self, cfg: Config) -> str:
        return self.wandb.util.generate_id()  # rank 0 creates the run under this id

    def _init(self, handle: TrackerRun):
        # The run's local files go to WANDB_DIR, else this user's private directory: not into the
        # working directory (where W&B would put ./wandb), which a run leaves alone.
        return self.wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "raytrain-hybrid",
            id=handle.run_id,
            resume="allow",  # a restarted worker group, and the driver's end, continue it
            name=run_name(Config.from_dict(handle.config)),
            config=handle.config,
            dir=os.environ.get("WANDB_DIR") or str(private_dir("wandb")),
        )

    def attach(self, handle: TrackerRun) -> None:
        self.run = self._init(handle)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def tag(self, key: str, value: str) -> None:
        self.run.summary[key] = value

    def detach(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)

    def end(self, handle: TrackerRun, summary: dict | None, status: str) -> None:
        run = self._init(handle)
        if summary:
            run.summary.update(numbers(_flat_summary(summary)))
        run.finish(exit_code=0 if status == "FINISHED" else 1)


_BACKENDS = {"mlflow": _Mlflow, "wandb": _Wandb}


def _backend(name: str):
    try:
        return _BACKENDS[name]()
    except ImportError as exc:  # a worker node without the extra
        raise ConfigError(
            "run.tracking", name, f"cannot import {name} ({exc}): pip install 'raytrain-hybrid[{name}]' on every node"
        ) from exc


def _share(env: dict[str, str]):
    """The driver's tracker variables into Ray's object store (see the module docstring)."""
    import ray

    return ray.put(env)


def _fetch(ref) -> dict[str, str]:
    import ray

    return ray.get(ref)


def _flat_summary(summary: dict) -> dict:
    """summary.json's scalars: the per-rank list and the evaluations are in the steps already."""
    return flatten({k: v for k, v in summary.items() if not isinstance(v, list)})


class TrackedRun:
    """The driver's side of one tracker run: ``open(cfg)`` once the checks are done and Ray is
    up (gives rank 0's handle); ``with tracked:`` around the training ends it FAILED (KILLED on
    Ctrl-C) when that raises; ``finish(summary)`` ends it FINISHED with the summary."""

    def __init__(self) -> None:
        self.backend = None
        self.handle: TrackerRun | None = None

    def open(self, cfg: Config) -> TrackerRun | None:
        if not cfg.run.tracking:
            return None
        name = cfg.run.tracking
        self.backend = _backend(name)
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES[name])}
        run_id = self.backend.create(cfg)
        self.handle = TrackerRun(name, run_id, cfg.to_dict(), _share(env))
        return self.handle

    def finish(self, summary: dict) -> None:
        if self.handle is not None:
            self.backend.end(self.handle, summary, "FINISHED")

    def __enter__(self) -> TrackedRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.handle is None or exc_type is None:
            return
        try:  # the run's own error is the one to see
            self.backend.end(self.handle, None, "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")
        except Exception as end_error:
            log.warning("could not end the %s run %s: %s", self.handle.backend, self.handle.run_id, end_error)


class StepLogger:
    """Rank 0's side: each step's metrics and each checkpoint into the driver's tracker run.
    ``with StepLogger.attach(handle, rank) as tracker:`` around the step loop; a no-op on other
    ranks and with tracking off."""

    def __init__(self, handle: TrackerRun | None) -> None:
        self.backend = None
        if handle is None:
            return
        os.environ.update(_fetch(handle.env))  # before the tracker's client reads them
        self.backend = _backend(handle.backend)
        self.backend.attach(handle)

    @classmethod
    def attach(cls, handle: TrackerRun | None, rank: int) -> StepLogger:
        return cls(handle if rank == 0 else None)

    def _guard(self, what: str, fn, *args) -> None:
        if self.backend is None:
            return
        try:
            fn(*args)
        except Exception as exc:  # tracking is a copy of metrics.jsonl: it must not end the run
            log.warning("run.tracking: could not log %s: %s", what, exc)

    def step(self, metrics: dict) -> None:
        """One step's metrics, on the step axis of metrics.jsonl and TensorBoard (0-based)."""
        if self.backend is not None:
            self._guard("a step", self.backend.log, metrics["step"], numbers(metrics))

    def checkpoint(self, steps_done: int, uri: str, metrics: dict) -> None:
        """A checkpoint after ``steps_done`` steps (its save times from ``metrics``), logged at
        the step axis of its last step."""
        if self.backend is not None:
            timings = {f"checkpoint.{k}": metrics[k] for k in ("blocked_s", "write_s", "save_s") if k in metrics}
            values = {"checkpoint.steps_done": steps_done, **timings}
            self._guard("a checkpoint", self.backend.log, steps_done - 1, numbers(values))
            self._guard("a checkpoint", self.backend.tag, "checkpoint.latest", uri)

    def __enter__(self) -> StepLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._guard("the end", getattr(self.backend, "detach", None), exc_type is None)
