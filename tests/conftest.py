"""One local Ray cluster per test session (starting Ray and torch workers costs tens of seconds)."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RAY_CPUS = 8


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=RAY_CPUS + 4,  # 8 workers, plus room for Ray Data read tasks and a Tune trial
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def run_layout(ray_local, tmp_path_factory):
    """Run a config (overrides on the defaults) through the launcher; return (history, summary)."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.driver import run

    def _run(overrides: list[str], name: str):
        out = tmp_path_factory.mktemp(name)
        cfg = load_config(None, [*overrides, f"run.output_dir={out}", "run.progress=false"])
        summary = run(cfg)
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        on_disk = json.loads((out / "summary.json").read_text())
        assert on_disk == json.loads(json.dumps(summary))
        return history, summary

    return _run


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
