"""The facts of the generic families recorded as data (models.generic_facts): equal to what the
installed transformers says, read instead of the family's classes, so that `check` of a Qwen3 or
Gemma checkpoint imports neither torch nor transformers; not read for another transformers version or
for a family registered in the process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raytrain_hybrid.models import generic, generic_facts


def test_the_recorded_facts_are_what_transformers_says():
    """Every family of the file derived afresh from its classes (plans, names, attention, config
    attribute names, and whether its sizes read as data equal its class's): equal, and every causal
    LM with a tensor-parallel plan is in it."""
    sys.path.insert(0, str(generic_facts.FACTS.parents[2] / "scripts"))
    from generic_facts import families  # scripts/generic_facts.py

    record = json.loads(generic_facts.FACTS.read_text())
    import transformers

    stale = "re-record with `.venv/bin/python scripts/generic_facts.py`"
    assert record["transformers"] == transformers.__version__, stale
    assert sorted(record["families"]) == families(), stale
    for model_type, facts in record["families"].items():
        derived = {k: v for k, v in facts.items() if k != "counts"}  # (held below, at other sizes)
        assert generic_facts.derive(model_type) == derived, f"{model_type}: {stale}"


# `raytrain-hybrid check ARGS` in this process, then what it resolved and imported.
CHECK = """
import sys
from raytrain_hybrid.cli import main
from raytrain_hybrid.config import load_config
args = sys.argv[1:]
try:
    rc = main(["check", *args])
except SystemExit as end:
    rc = end.code
assert not rc, rc
cfg = load_config(None, [a for a in args if a != "--set" and "=" in a])
print(cfg.model.arch, cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "olmo2", "phi3"])
def test_a_checkpoint_of_a_generic_family_resolves_without_torch_or_transformers(model_type, tmp_path):
    """`check --hardware h100` of a checkpoint saved by transformers passes, resolving its family
    and sizes and planning it in a process that never imports torch or transformers (the planner
    counts its weights off their safetensors headers): the sizes its config class gives."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    sets = [f"model.pretrained={tmp_path}", "data.path=memory", "model.seq_len=32"]
    args = [a for kv in sets for a in ("--set", kv)]
    done = subprocess.run(
        [sys.executable, "-c", CHECK, "--hardware", "h100", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved, imported = done.stdout.splitlines()[-2:]
    assert resolved == f"{model_type} 3 2 16", done.stdout
    assert "layout ok" in done.stdout and "planner: H100-80GB SXM, 8 ranks" in done.stdout, done.stdout
    assert imported == "[]", done.stdout  # (the planner counted the weights off their headers)
    want = generic.sizes_from_class(model_type, json.loads((tmp_path / "config.json").read_text()))
    assert (want["num_layers"], want["num_kv_heads"], want["head_dim"]) == (3, 2, 16)


def test_the_classes_answer_for_another_transformers_or_a_family_registered_here(monkeypatch, tmp_path):
    """Facts recorded for another transformers version are not read; nor those of a model_type
    registered in this process (models.custom), whose own classes then answer."""
    assert generic_facts.recorded("qwen3") is not None
    other = tmp_path / "facts.json"
    other.write_text(json.dumps({**json.loads(generic_facts.FACTS.read_text()), "transformers": "0.0.1"}))
    monkeypatch.setattr(generic_facts, "FACTS", other)
    generic_facts._file.cache_clear()
    try:
        assert generic_facts.recorded("qwen3") is None
        assert generic.has_pp_plan("qwen3") and generic.pp_names("qwen3") == ("embed_tokens", "layers", "norm")
    finally:
        generic_facts._file.cache_clear()
    monkeypatch.setattr(generic_facts, "_OVERRIDDEN", {"qwen3"})
    assert generic_facts.recorded("qwen3") is None
    assert generic.head_name("qwen3") == "lm_head" and generic._prefix("qwen3") == "model"


def test_sizes_read_as_data_need_every_key_the_class_would_fill_in():
    """A config.json without a key the class would default (num_key_value_heads) is read through the
    class, not guessed; with every key, as data."""
    conf = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}  # fmt: skip
    assert generic_facts.sizes("qwen3", conf) == generic.sizes_from_class("qwen3", conf)
    assert generic_facts.sizes("qwen3", {k: v for k, v in conf.items() if k != "num_key_value_heads"}) is None
    assert generic_facts.sizes("qwen3", {**conf, "head_dim": [16, 32]}) is None


def test_the_hand_written_model_types_are_the_specs_own():
    """models.HAND_MODEL_TYPES (a checkpoint's hand-written family found by name, without importing
    every spec) is what the specs themselves declare."""
    from raytrain_hybrid.models import HAND_MODEL_TYPES, arch_names, get_arch

    assert HAND_MODEL_TYPES == {mt: name for name in arch_names("lm") for mt in get_arch(name).hf_model_types}


def _qwen3(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "header",
    [
        '{"model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": [Infinity, 1], "data_offsets": [0, 4]}}',
        '{"model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": [-10000000, 1], "data_offsets": [0, 4]}}',
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["infinite shape", "negative shape", "nested 100,000 deep"],
)
def test_a_header_that_is_not_one_is_not_counted_and_check_still_answers(header, tmp_path):
    """A safetensors header no writer makes (an infinite or negative dimension, arrays nested deep)
    is not believed by the planner's header count (models.hf_checkpoint.tensor_sizes): it counts the
    model built from the config instead, and `check --hardware` answers as for the sound checkpoint."""
    from raytrain_hybrid.models import generic_counts
    from raytrain_hybrid.models.hf_checkpoint import tensor_sizes

    path = _qwen3(tmp_path / "q")
    m = {"pretrained": str(path), "pretrained_revision": ""}
    sound = generic_counts.from_headers("qwen3", m)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    weights.write_bytes(len(header).to_bytes(8, "little") + header.encode() + data[8 + n :])
    assert tensor_sizes(str(path)) is None and generic_counts.from_headers("qwen3", m) is None
    assert generic_counts.built_counts("qwen3", m) == sound
    sets = [a for kv in (f"model.pretrained={path}", "data.path=memory", "model.seq_len=32") for a in ("--set", kv)]
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_hybrid.cli", "check", "--hardware", "h100", *sets],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "planner: H100-80GB SXM" in done.stdout, done.stderr[-2000:]


def test_a_config_json_its_class_refuses_is_refused_naming_it(tmp_path):
    """A size set to null (which the sizes as data would fill in) is left to transformers' config
    class, which refuses it: `check` says so, exit 2, naming model.pretrained."""
    path = _qwen3(tmp_path / "q")
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "intermediate_size": None}))
    assert generic_facts.sizes("qwen3", {**conf, "intermediate_size": None}) is None
    sets = [a for kv in (f"model.pretrained={path}", "data.path=memory", "model.seq_len=32") for a in ("--set", kv)]
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_hybrid.cli", "check", *sets], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: model.pretrained='{path}': has a config.json that does not describe")
    assert "intermediate_size" in done.stderr and "Traceback" not in done.stderr


# Families whose count polynomials are held at sizes they were not fitted at: dense ones with and
# without tied embeddings, query/key norms, biases, a fused projection, MoE with and without a shared
# expert, and learned positions where one has them.
COUNTED = ["qwen3", "gemma3_text", "olmo2", "phi3", "starcoder2", "qwen2_moe", "granite", "glm4", "cohere2"]


@pytest.mark.parametrize("model_type", COUNTED)
def test_the_recorded_count_polynomials_are_what_transformers_builds(model_type):
    """The planner's parameter counts of model.* sizes (no checkpoint) read off the family's
    recorded polynomials equal those of the model transformers builds on the meta device, at sizes
    drawn apart from the ones they were fitted at (also with 40 layers); the polynomials are not
    read where the family's kv heads do not divide its heads (the class would refuse the sizes)."""
    import random

    from raytrain_hybrid.models import generic_counts

    sys.path.insert(0, str(generic_facts.FACTS.parents[2] / "scripts"))
    from generic_facts import REALISTIC, probe  # scripts/generic_facts.py

    assert generic_facts.recorded(model_type).get("counts"), f"{model_type}: no count polynomials recorded"
    rng = random.Random(f"held apart {model_type}")
    for m in [probe(rng, layers) for layers in (None, None, 40)] + list(REALISTIC[:1]):
        assert generic_counts.from_polynomials(model_type, m) == generic_counts.built_counts(model_type, m), m
    assert generic_counts.from_polynomials(model_type, {**m, "num_heads": 3, "num_kv_heads": 2}) is None


def test_random_weights_named_none_are_counted_as_random_weights():
    """model.pretrained=none (random weights, as the error messages offer) is counted off the
    polynomials as an empty one is, not read as a checkpoint named "none"."""
    from raytrain_hybrid.models import generic_counts

    m = {"vocab_size": 512, "hidden_size": 64, "ffn_hidden_size": 128, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "num_layers": 2, "seq_len": 32, "pretrained_revision": ""}  # fmt: skip
    counted = [generic_counts._counts("qwen3", tuple({**m, "pretrained": p}.items())) for p in ("", "none", "None")]
    assert counted[0] == counted[1] == counted[2] == generic_counts.from_polynomials("qwen3", {**m, "pretrained": ""})


def test_a_family_that_rounds_a_width_has_no_count_polynomials():
    """LFM2 rounds its FFN width up to a multiple of 256: at the small sizes the fit probes, every width
    rounds to 256 and its counts looked like polynomials without an FFN term (5x too few parameters a
    block at 1.2B sizes). Held to released models' widths too, it has none, and is counted as built."""
    from raytrain_hybrid.models import generic_counts

    sys.path.insert(0, str(generic_facts.FACTS.parents[2] / "scripts"))
    from generic_facts import REALISTIC  # scripts/generic_facts.py

    assert not generic_facts.recorded("lfm2").get("counts")
    m = REALISTIC[1]
    assert generic_counts.from_polynomials("lfm2", m) is None
    blocks, *_ = generic_counts.built_parts("lfm2", m)
    assert blocks[0] > 2 * m["hidden_size"] * m["ffn_hidden_size"]  # (the polynomials' block: 14.2M of 38M)


def test_a_family_without_count_polynomials_is_counted_on_the_model_built():
    """A family recorded without polynomials (its blocks differ: Gemma 3n's per-layer widths) is
    counted by building it; so is a model.* size no polynomial was fitted for (a zero width)."""
    from raytrain_hybrid.models import generic_counts

    families = json.loads(generic_facts.FACTS.read_text())["families"]
    without = sorted(mt for mt, facts in families.items() if "counts" not in facts)
    assert "gemma3n_text" in without, without
    sized = {"vocab_size": 512, "hidden_size": 64, "ffn_hidden_size": 128, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 16, "num_layers": 2, "seq_len": 32, "pretrained": "", "pretrained_revision": ""}  # fmt: skip
    assert generic_counts.from_polynomials("gemma3n_text", sized) is None
    assert generic_counts.from_polynomials("qwen3", {**sized, "ffn_hidden_size": 0}) is None


@pytest.mark.parametrize("model_type", ["qwen3", "phi3"])
def test_a_random_weight_generic_model_is_planned_without_torch_or_transformers(model_type):
    """`check --hardware h100` of model.arch=<family> with model.* sizes (no checkpoint) plans it in
    a process that never imports torch or transformers: its counts come from the recorded
    polynomials (before them, the model was built on the meta device: about 5 s here)."""
    sets = [f"model.arch={model_type}", "data.path=memory", "model.seq_len=32", "model.num_layers=3"]
    args = [a for kv in sets for a in ("--set", kv)]
    done = subprocess.run(
        [sys.executable, "-c", CHECK, "--hardware", "h100", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planner: H100-80GB SXM, 8 ranks" in done.stdout, done.stdout
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


def test_the_base_model_is_the_attribute_the_causal_lm_sets():
    """Llama 4's text LM names "language_model" as its base_model_prefix (the multimodal model's
    attribute) and holds its decoder as ``self.model``: the generic path reads the attribute its
    __init__ sets; a prefix the class does set (GPT-2's "transformer") stays."""
    from transformers import GPT2LMHeadModel, Llama4ForCausalLM, Qwen3ForCausalLM

    assert Llama4ForCausalLM.base_model_prefix == "language_model"
    assert generic_facts.prefix_of(Llama4ForCausalLM) == "model"
    assert generic_facts.prefix_of(Qwen3ForCausalLM) == "model"
    assert generic_facts.prefix_of(GPT2LMHeadModel) == "transformer"
    assert generic_facts.recorded("llama4_text")["prefix"] == "model"
