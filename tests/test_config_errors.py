"""A config's mistakes said at once, as the CLI prints them: each unknown or invalid key with its
file and line (a TOML file) and, for a misspelt key, the closest known one."""

from __future__ import annotations

import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.config.report import ConfigErrors, key_lines
from raytrain_hybrid.errors import ConfigError

BAD = """# a run with five mistakes
[parallelism]
dpp = 2
tp = 0

[train]
steps = 10
lr = "fast"
"warmup_stepz" = 3

[modle]
arch = "llama"
"""


def test_every_mistake_is_said_at_once_with_its_line_and_the_closest_key(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(BAD)
    assert cli.main(["check", str(path), "--set", "data.pth=x", "--set", "train.global_batch_size=many"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: 7 mistakes in the config:",
        f"  parallelism.dpp=2: is not a known key; did you mean parallelism.dp? ({path}:3)",
        f"  parallelism.tp=0: must be >= 1 ({path}:4)",
        f"  train.lr='fast': must be a number ({path}:8)",
        f"  train.warmup_stepz=3: is not a known key; did you mean train.warmup_steps? ({path}:9)",
        "  train.global_batch_size='many': must be an integer",
        f"  modle={{'arch': 'llama'}}: is not a known key; did you mean model? ({path}:11)",
        "  data.pth='x': is not a known key; did you mean data.path?",
    ], err


def test_one_mistake_reads_as_before_and_keeps_its_key():
    one = r"^parallelism\.tpp='2': is not a known key; did you mean parallelism\.tp\?$"
    with pytest.raises(ConfigError, match=one):
        load_config(None, ["parallelism.tpp=2"])
    with pytest.raises(ConfigErrors) as info:
        load_config(None, ["train.lr=x", "train.steps=0"])
    assert info.value.key == "train.lr" and [e.key for e in info.value.errors] == ["train.lr", "train.steps"]
    # Nothing close: the section's keys.
    with pytest.raises(ConfigError, match=r"lora\.zzzzzz='1': is not a known key; known keys here: \{alpha, "):
        load_config(None, ["lora.zzzzzz=1"])


def test_key_lines_reads_tables_dotted_and_quoted_keys_and_skips_arrays():
    text = 'a = 1\n[s]\nx.y = [\n  "k = v",\n]\n"q" = 2\n[[t]]\nz=3\n'
    assert key_lines(text) == {"a": 1, "s": 2, "s.x.y": 3, "s.q": 6, "t": 7, "t.z": 8}


def test_lora_targets_that_name_no_linear_are_refused_with_the_linears_that_would_work(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(
        "qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path / "q3")
    sets = [f"model.pretrained={tmp_path / 'q3'}", "data.path=memory", "lora.rank=4", 'lora.targets=["qkv"]']
    with pytest.raises(ConfigError) as caught:
        load_config(None, sets)
    said = str(caught.value)
    assert "lora.targets=['qkv']: 'qkv' matches no linear of the qwen3 blocks; use some of " in said, said
    assert "q_proj" in said and "'all-linear'" in said, said


def test_a_boolean_is_said_as_the_user_writes_it():
    assert str(ConfigError("data.packing", True, "not for this family")) == "data.packing=true: not for this family"
    assert str(ConfigError("train.steps", 0, "must be > 0")) == "train.steps=0: must be > 0"
