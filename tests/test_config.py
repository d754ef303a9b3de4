"""Configuration: defaults, files, --set overrides, defaults resolved in one step, and bad input
refused before any worker starts."""

from __future__ import annotations

import builtins
import dataclasses
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.config import ARCHS, Config, load_config, resolve_defaults, validate
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import ARCH_NAMES, get_arch


def test_default_is_a_small_3d_llama():
    cfg = load_config()
    par = cfg.parallelism
    assert (par.dp, par.tp, par.pp) == (2, 2, 2)
    assert cfg.model.arch == "llama"
    assert par.world_size == 8


def test_file_then_overrides(tmp_path: Path):
    path = tmp_path / "run.toml"
    path.write_text('[parallelism]\ndp = 4\ntp = 1\npp = 2\n[model]\narch = "gpt2"\n[train]\nlr = 1e-3\n')
    cfg = load_config(path, ["parallelism.dp=1", "train.dtype=bfloat16", "parallelism.activation_checkpointing=true"])
    assert (cfg.parallelism.dp, cfg.parallelism.pp, cfg.model.arch) == (1, 2, "gpt2")
    assert cfg.train.lr == 1e-3 and cfg.train.dtype == "bfloat16"
    assert cfg.parallelism.activation_checkpointing is True
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size


def test_round_trip_through_dict():
    cfg = load_config(None, ["model.num_kv_heads=2"])
    again = type(cfg).from_dict(cfg.to_dict())
    assert again == cfg


BAD = {
    "world": (["parallelism.tp=0"], "parallelism.tp"),
    "tp-heads": (["parallelism.tp=3"], "parallelism.tp"),
    "tp-kv-heads": (["model.num_kv_heads=1", "parallelism.tp=2"], "parallelism.tp"),
    "pp-layers": (["parallelism.pp=8"], "parallelism.pp"),
    "interleaved-layers": (["parallelism.schedule=Interleaved1F1B", "model.num_layers=3"], "parallelism.pp"),
    "schedule": (["parallelism.schedule=Zigzag"], "parallelism.schedule"),
    "zero": (["parallelism.zero=4"], "parallelism.zero"),
    "sp-seq-len": (["parallelism.tp=4", "model.num_heads=8", "model.seq_len=130"], "parallelism.tp"),
    "batch": (["train.global_batch_size=12"], "train.global_batch_size"),
    "microbatches-1f1b": (["parallelism.microbatches=1"], "parallelism.microbatches"),
    "dualpipev-mb": (["parallelism.schedule=DualPipeV", "parallelism.microbatches=2"], "microbatches=2: DualPipeV"),
    "unknown-key": (["parallelism.sp=2"], "parallelism.sp"),
    "unknown-section": (["optim.lr=1"], "optim"),
    "wrong-type-int": (["train.steps=ten"], "train.steps"),
    "wrong-type-bool": (["parallelism.activation_checkpointing=maybe"], "parallelism.activation_checkpointing"),
    "dtype": (["train.dtype=float16"], "train.dtype"),
    "arch": (["model.arch=mamba"], "model.arch"),
    "heads-hidden": (["model.num_heads=5"], "model.num_heads"),
    "gpt2-gqa": (["model.arch=gpt2", "model.num_kv_heads=2"], "model.num_kv_heads"),
    "lr": (["train.lr=-1"], "train.lr"),
    "no-equals": (["parallelism.tp"], "parallelism.tp"),
    "tracking": (["run.tracking=tensorboard"], "run.tracking"),
    "profile-one-step": (["run.profile_steps=3"], "run.profile_steps=[3]: must be [first, last]"),
    "profile-reversed": (["run.profile_steps=[3,2]"], "1 <= first <= last"),
    "profile-past-end": (["run.profile_steps=19,21", "train.steps=20"], "ends after train.steps=20"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_names_key_and_exits_before_workers(name, monkeypatch, capsys):
    overrides, key = BAD[name]

    def must_not_launch(cfg):
        raise AssertionError("workers were started for an invalid config")

    monkeypatch.setattr("raytrain_hybrid.launch.runtime.driver.run", must_not_launch)
    argv = ["train"] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and key in err, err


def test_ray_train_v1_is_refused_before_ray_starts(monkeypatch, capsys):
    """The launcher is built on Ray Train V2 (Ray's default, so it sets nothing itself)."""
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "0")
    monkeypatch.setattr("raytrain_hybrid.launch.runtime.start.join_ray", lambda *a, **k: pytest.fail("Ray was started"))
    assert cli.main(["train", "--set", "train.steps=1", "--set", "data.path=memory"]) == 2
    err = capsys.readouterr().err
    assert "RAY_TRAIN_V2_ENABLED='0'" in err and "unset the variable or set it to 1" in err, err


def test_error_suggests_what_works():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["parallelism.tp=3"])
    assert "try tp in {1, 2, 4}" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.global_batch_size=12"])
    assert "dp*microbatches=2*4=8" in str(info.value)


def test_bad_toml_file(tmp_path: Path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallelism\ndp = 2\n")
    assert cli.main(["train", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert cli.main(["train", str(tmp_path / "missing.toml")]) == 2


def test_console_script_exits_nonzero_on_bad_input():
    exe = Path(sys.executable).parent / "raytrain-hybrid"
    proc = subprocess.run([str(exe), "train", "--set", "parallelism.pp=16"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "parallelism.pp=16" in proc.stderr


# (overrides, expected values after resolve_defaults): "0 picks" per architecture, the
# classifier's columns on the shipped data, a pretrained checkpoint's sizes (all-MiniLM-L6-v2).
RESOLVED = {
    "llama": ([], {"train.lr": 3e-3, "model.num_kv_heads": 4, "model.ffn_hidden_size": 352}),
    "llama-set": (
        ["train.lr=1e-4", "model.num_kv_heads=2", "model.ffn_hidden_size=256"],
        {"train.lr": 1e-4, "model.num_kv_heads": 2, "model.ffn_hidden_size": 256},
    ),
    "llama-wide": (["model.hidden_size=4096", "model.num_heads=32"], {"model.ffn_hidden_size": 10944}),
    "gpt2": (["model.arch=gpt2"], {"train.lr": 3e-3, "model.num_kv_heads": 4, "model.ffn_hidden_size": 512}),
    "classifier-builtin": (
        ["model.arch=multimodal-bert"],
        {
            "train.lr": 2e-4,
            "data.text_columns": ["dialogue", "shiptrack"],
            "data.tabular_columns": ["feature_1", "feature_2", "feature_3"],
            "model.num_layers": 6,
            "model.hidden_size": 384,
            "model.num_heads": 12,
            "model.num_kv_heads": 12,
            "model.ffn_hidden_size": 1536,
            "model.vocab_size": 30522,
        },
    ),
    "classifier-own-columns": (
        ["model.arch=multimodal-bert", "data.path=memory", "data.text_columns=a,b"],
        {"data.text_columns": ["a", "b"], "data.tabular_columns": ["feature_1", "feature_2", "feature_3"]},
    ),
    "classifier-own-data": (
        ["model.arch=multimodal-bert", "data.path=rows.parquet", "data.text_columns=a,b", "data.tabular_columns=c"],
        {"data.text_columns": ["a", "b"], "data.tabular_columns": ["c"]},
    ),
    "classifier-random": (
        ["model.arch=multimodal-bert", "model.pretrained=none", "model.hidden_size=32", "model.num_heads=4"],
        {"model.num_layers": 4, "model.hidden_size": 32, "model.num_kv_heads": 4, "model.ffn_hidden_size": 128},
    ),
}


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


@pytest.mark.parametrize("name", list(RESOLVED))
def test_resolve_defaults_fills_what_0_and_empty_pick(name):
    from raytrain_hybrid.config import parse_overrides

    overrides, want = RESOLVED[name]
    parsed = Config.from_dict(parse_overrides(overrides))
    resolved = resolve_defaults(parsed)
    assert {key: _get(resolved, key) for key in want} == want
    assert resolved is not parsed and Config.from_dict(parse_overrides(overrides)) == parsed  # a new config
    assert load_config(None, overrides) == resolved


def test_parsing_reads_no_file_and_fills_nothing():
    cfg = Config.from_dict({"model": {"arch": "multimodal-bert", "pretrained": "/nonexistent/bert"}})
    assert (cfg.model.num_kv_heads, cfg.model.ffn_hidden_size, cfg.train.lr) == (0, 0, 0.0)
    assert cfg.data.text_columns == [] and cfg.model.num_layers == 4
    with pytest.raises(ConfigError, match="model.pretrained='/nonexistent/bert': has no config.json"):
        resolve_defaults(cfg)  # the one step that reads the checkpoint's config.json


@pytest.mark.parametrize(
    "overrides", [[], ["model.arch=gpt2"], ["model.arch=multimodal-bert"], ["model.num_kv_heads=2"]]
)
def test_resolving_a_saved_config_changes_nothing(overrides):
    """A run's config.json and a checkpoint manifest save the resolved config: the worker's and
    export's Config.from_dict of it is resolved already."""
    cfg = load_config(None, overrides)
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg and resolve_defaults(again) == cfg


def test_validate_reads_no_file_and_changes_nothing(monkeypatch):
    cfg = load_config(None, ["model.arch=multimodal-bert"])
    before = cfg.to_dict()

    def no_reading(*args, **kwargs):
        raise AssertionError("validate read a file")

    monkeypatch.setattr(builtins, "open", no_reading)
    monkeypatch.setattr(pathlib.Path, "read_text", no_reading)
    validate(cfg)
    monkeypatch.undo()
    assert cfg.to_dict() == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_validate_refuses_an_unresolved_config():
    with pytest.raises(ValueError, match="resolve_defaults"):
        validate(Config())


def test_architectures_come_from_the_registry():
    assert ARCHS == ARCH_NAMES
    for name in ARCH_NAMES:
        assert get_arch(name).name == name
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.arch=mamba"])
    assert all(name in str(info.value) for name in ARCH_NAMES), info.value
    assert info.value.key == "model.arch"
    # A transformers model_type that is no transformer decoder is refused saying why.
    with pytest.raises(ConfigError, match="is not a transformer decoder") as info:
        get_arch("mamba")
    assert all(name in str(info.value) for name in ARCH_NAMES), info.value


def test_shared_fs_is_refused_with_an_object_store_uri():
    with pytest.raises(ConfigError, match="run.shared_fs"):
        load_config(None, ["run.output_dir=s3://bucket/run", "run.shared_fs=true"])
    assert load_config(None, ["run.output_dir=/mnt/shared/run", "run.shared_fs=true"]).run.shared_fs
