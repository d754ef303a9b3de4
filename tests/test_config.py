"""Configuration: defaults, files, --set overrides, and bad input refused before any worker starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError


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
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_names_key_and_exits_before_workers(name, monkeypatch, capsys):
    overrides, key = BAD[name]

    def must_not_launch(cfg):
        raise AssertionError("workers were started for an invalid config")

    monkeypatch.setattr("raytrain_hybrid.launch.driver.run", must_not_launch)
    argv = ["train"] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and key in err, err


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
