"""run.tracking without Ray: a tracker that is not installed is refused before Ray starts, naming
the extra; the W&B adapter against a stand-in module (wandb is not a test dependency); MLflow's
run ends FAILED when the run fails (a local file store). The CLI run that MLflow tracks from
rank 0 is in test_cli_ray.py."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.records import tracking
from raytrain_hybrid.launch.records.tracking import StepLogger, TrackedRun


@pytest.fixture
def no_ray(monkeypatch):
    # The driver hands rank 0 its tracker variables through Ray's object store; here by value.
    monkeypatch.setattr(tracking, "_share", lambda env: dict(env))
    monkeypatch.setattr(tracking, "_fetch", lambda ref: ref)


def test_off_by_default_and_an_unknown_tracker_is_refused_naming_what_works():
    assert load_config().run.tracking == ""
    with pytest.raises(ConfigError, match=r"run.tracking='tensorboard': must be one of \{mlflow, wandb\}"):
        load_config(None, ["run.tracking=tensorboard"])


def test_a_tracker_that_is_not_installed_is_refused_before_ray_starts(monkeypatch, tmp_path, capsys):
    import ray

    from raytrain_hybrid.launch.runtime import start

    monkeypatch.setitem(sys.modules, "wandb", None)  # what importing it finds: not installed
    started: list = []  # Ray may run already (other tests in this process): record any start or join
    monkeypatch.setattr(start, "join_ray", lambda *a, **k: started.append("join_ray"))
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    # A local run, as from a shell: not the Ray this test process may have joined already.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    out = tmp_path / "run"
    assert cli.main(["train", "--set", "run.tracking=wandb", "--set", f"run.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "run.tracking='wandb'" in err and "pip install 'raytrain-hybrid[wandb]'" in err, err
    assert not out.exists()
    assert started == []


class FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls, self.summary = calls, {}

    def log(self, values: dict, step: int) -> None:
        if values.get("loss") == -1.0:
            raise ConnectionError("W&B is unreachable")
        self.calls.append(("log", step, values))

    def finish(self, exit_code: int) -> None:
        self.calls.append(("finish", exit_code, dict(self.summary)))


class FakeWandb(types.ModuleType):
    """The calls the adapter makes on ``wandb``, recorded."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.calls: list = []
        self.util = types.SimpleNamespace(generate_id=lambda: "run-abc")

    def init(self, **kwargs) -> FakeRun:
        self.calls.append(("init", kwargs))
        return FakeRun(self.calls)


def test_wandb_gets_the_config_rank_0s_steps_its_checkpoints_and_the_summary(monkeypatch, no_ray, caplog):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(None, ["run.tracking=wandb"])
    tracked = TrackedRun()
    handle = tracked.open(cfg)
    assert handle.run_id == "run-abc" and wandb.calls == []  # rank 0 creates the run
    assert StepLogger.attach(handle, rank=1).backend is None  # other ranks log nothing

    monkeypatch.delenv("WANDB_PROJECT")  # a worker node without it: rank 0 gets the driver's
    with StepLogger.attach(handle, rank=0) as logger:
        logger.step({"step": 0, "loss": 8.0, "grad_norm": 1.5, "lr": 1e-3, "mfu": None})
        with caplog.at_level(logging.WARNING):
            logger.step({"step": 1, "loss": -1.0})  # the tracker fails: a warning, the run goes on
        assert "W&B is unreachable" in caplog.text
        logger.step({"step": 1, "loss": 7.5, "grad_norm": 1.2, "lr": 2e-3, "mfu": None})
        logger.checkpoint(2, "s3://bucket/run/checkpoints/step_2", {"loss": 7.5, "save_s": 0.5, "write_s": 0.25})
    with tracked:
        pass
    tracked.finish({"final_loss": 7.5, "steps": 2, "layout": {"dp": 2}, "per_rank": [{"rank": 0}]})

    init, *rank0, driver_init, driver_finish = wandb.calls
    for call in (init, driver_init):
        kwargs = call[1]
        assert (kwargs["id"], kwargs["resume"], kwargs["project"]) == ("run-abc", "allow", "proj")
        assert kwargs["config"] == cfg.to_dict()
    assert rank0 == [
        ("log", 0, {"loss": 8.0, "grad_norm": 1.5, "lr": 1e-3}),
        ("log", 1, {"loss": 7.5, "grad_norm": 1.2, "lr": 2e-3}),
        ("log", 1, {"checkpoint.steps_done": 2.0, "checkpoint.write_s": 0.25, "checkpoint.save_s": 0.5}),
        ("finish", 0, {"checkpoint.latest": "s3://bucket/run/checkpoints/step_2"}),
    ]
    assert driver_finish == ("finish", 0, {"final_loss": 7.5, "steps": 2.0, "layout.dp": 2.0})

    failed = TrackedRun()
    failed.open(cfg)
    with pytest.raises(RuntimeError), failed:
        raise RuntimeError("a worker died")
    assert wandb.calls[-1][:2] == ("finish", 1)


def test_mlflow_run_ends_failed_when_the_run_fails(monkeypatch, no_ray, tmp_path):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "unit")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    cfg = load_config(None, ["run.tracking=mlflow", "parallelism.tp=1"])
    tracked = TrackedRun()
    handle = tracked.open(cfg)
    with pytest.raises(RuntimeError), tracked:
        with StepLogger.attach(handle, rank=0) as logger:
            logger.step({"step": 0, "loss": 9.0, "grad_norm": 2.0})
            raise RuntimeError("a worker died")
    client = MlflowClient()
    run = client.get_run(handle.run_id)
    assert run.info.status == "FAILED"
    assert client.get_experiment(run.info.experiment_id).name == "unit"
    assert run.data.params["parallelism.tp"] == "1" and run.data.params["run.tracking"] == "mlflow"
    assert [(m.step, m.value) for m in client.get_metric_history(handle.run_id, "loss")] == [(0, 9.0)]
