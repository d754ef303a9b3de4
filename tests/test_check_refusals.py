"""Every refusal `train` gives before its first step, `check` gives too: the same message on stderr
and the same exit code, in under 3 s. One table of bad inputs, each entered as a user does
(the CLI, real files); `train` is stopped where it would start Ray, so a case that `train` lets
through to Ray's start fails here instead of waiting for a cluster."""

from __future__ import annotations

import json
import os
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_hybrid import cli
from raytrain_hybrid.launch.runtime import start

TINY = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"]
TOKENS = pa.table({"input_ids": pa.array([[1, 2, 3]] * 8, type=pa.list_(pa.int32()))})
TEXT = pa.table({"body": ["some text here"] * 8})


class RayStarted(BaseException):
    """`train` went past its checks to Ray's start."""


def _tokens(d):
    pq.write_table(TOKENS, d / "tokens.parquet")
    return d / "tokens.parquet"


def _text(d):
    pq.write_table(TEXT, d / "text.parquet")
    return d / "text.parquet"


def _rows(d, n=16):
    pq.write_table(
        pa.table({"title": ["a b"] * n, "body": ["c d"] * n, "x": [0.5] * n, "label": [0, 1] * (n // 2)}),
        d / "rows.parquet",
    )
    return d / "rows.parquet"


def _file(d, name, body: bytes = b"not parquet"):
    (d / name).write_bytes(body)
    return d / name


def _manifest_run(d):
    step = d / "out" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    return d / "out"


def _no_weights(d):
    model = d / "model"
    model.mkdir()
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}
    config = {
        "model_type": "llama",
        **sizes,
        "intermediate_size": 64,
        "vocab_size": 4096,
        "max_position_embeddings": 256,
    }
    (model / "config.json").write_text(json.dumps(config))
    (model / "pytorch_model.bin").write_bytes(b"x")
    return model


def _quantized(d, said: str = "config"):
    """A checkpoint as Hugging Face's FP8 releases ship it: config.json's quantization_config, and
    weights in float8 beside their inverse scales (the scales are what the name-by-name load would
    lose). ``said``: where config.json says so ("config"; "text_config", as a multimodal release
    nests it; "nowhere": a stripped config.json, the weights alone say it)."""
    import torch
    from safetensors.torch import save_file

    model = _no_weights(d)
    (model / "pytorch_model.bin").unlink()
    config = json.loads((model / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if said == "config":
        config["quantization_config"] = quant
    elif said == "text_config":
        config["text_config"] = {"quantization_config": quant}
    (model / "config.json").write_text(json.dumps(config))
    weight = torch.ones(32, 32).to(torch.float8_e4m3fn)
    scales = {"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1)}
    save_file({"model.layers.0.self_attn.q_proj.weight": weight, **scales}, str(model / "model.safetensors"))
    return model


def _adapter(d, with_config: bool = False):
    """What `save_pretrained` of a peft model writes: an adapter that names its base model;
    ``with_config``: and the base model's config.json beside it, as some trainers write."""
    adapter = _no_weights(d) if with_config else d / "adapter"
    if with_config:
        (adapter / "pytorch_model.bin").unlink()
    else:
        adapter.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": "Qwen/Qwen3-0.6B", "r": 8, "target_modules": ["q_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return adapter


# id: (--set values, each with {d} for the case's directory and the files it makes, extra argv, what stderr holds)
CASES = {
    "data missing (relative)": (["data.path=data/nope.parquet"], [], "data.path='data/nope.parquet': does not exist"),
    "data missing (absolute)": (["data.path={d}/nope"], [], "nope': does not exist; give a Parquet file"),
    "data not Parquet": (["data.path={notpq}"], [], "cannot be read as Parquet"),
    "data dir without Parquet": (["data.path={d}"], [], "holds no Parquet files"),
    "data dir with a broken file": (["data.path={d}"], ["tokens", "broken"], "cannot be read as Parquet: "),
    "token column missing": (
        ["data.path={text}"],
        [],
        "data.token_column='input_ids': is not a column of {text}, which has columns body; name one of them",
    ),
    "text column missing": (
        ["data.path={text}", "data.text_column=text"],
        [],
        "data.text_column='text': is not a column of {text}, which has columns body",
    ),
    "text column not text": (["data.path={tokens}", "data.text_column=input_ids"], [], "not text; use data.token_"),
    "token column not ids": (["data.path={text}", "data.token_column=body"], [], "not a list of integer token ids"),
    "no rows": (["data.path={empty}"], [], "has no rows"),
    "tokenizer too large (text)": (
        ["data.path={text}", "data.text_column=body", "model.vocab_size=1024"],
        [],
        "has 4096 tokens, more than model.vocab_size=1024",
    ),
    "tokenizer too large (builtin)": (["model.vocab_size=1024"], [], "has 4096 tokens, more than model.vocab_size"),
    "tokenizer missing": (
        ["data.path={text}", "data.text_column=body", "data.tokenizer={d}/nope.json"],
        [],
        "data.tokenizer=",
    ),
    "val_path missing": (
        [
            "model.arch=multimodal-bert",
            "data.path={rows}",
            "data.text_columns=title,body",
            "data.tabular_columns=x",
            "data.val_path={d}/val",
        ],
        [],
        "data.val_path='{d}/val': does not exist",
    ),
    "earlier checkpoints": (["data.path=memory", "run.output_dir={ckpts}"], [], "holds checkpoints of an earlier run"),
    "busy output directory": (["data.path=memory"], ["lease"], "is in use by another run (host "),
    "resume missing": (["data.path=memory"], ["--resume", "{d}/gone"], "--resume="),
    "placeholder in data.path": (["data.path=s3://<your-bucket>/x"], [], "replace <your-bucket> with your bucket"),
    "placeholder in output_dir": (["run.output_dir=s3://<your-bucket>/r"], [], "replace <your-bucket>"),
    "pretrained missing": (["model.pretrained={d}/nomodel"], [], "model.pretrained="),
    "pretrained without safetensors": (
        ["model.pretrained={model}", "data.path=memory"],
        [],
        "has no *.safetensors weights next to config.json (it has pytorch_model.bin",
    ),
    "pretrained quantized": (
        ["model.pretrained={quantized}", "data.path=memory"],
        [],
        "is a quantized checkpoint (config.json's quantization_config: quant_method='fp8')",
    ),
    "pretrained quantized, said in its text_config": (
        ["model.pretrained={quantized_text}", "data.path=memory"],
        [],
        "is a quantized checkpoint (config.json's quantization_config: quant_method='fp8')",
    ),
    "pretrained quantized, said by its weights alone": (
        ["model.pretrained={quantized_silent}", "data.path=memory"],
        [],
        "stores model.layers.0.self_attn.q_proj.weight as F8_E4M3, a quantized type, although its config.json "
        "has no quantization_config; give the model's unquantized checkpoint",
    ),
    "pretrained is an adapter": (
        ["model.pretrained={adapter}", "data.path=memory"],
        [],
        "is a PEFT adapter (adapter_config.json), not a model; give model.pretrained='Qwen/Qwen3-0.6B' as "
        "the checkpoint",
    ),
    "pretrained is an adapter beside its base's config.json": (
        ["model.pretrained={adapter_with_config}", "data.path=memory"],
        [],
        "is a PEFT adapter (adapter_config.json), not a model; give model.pretrained='Qwen/Qwen3-0.6B'",
    ),
    "tracker not installed": (["data.path=memory", "run.tracking=wandb"], [], "needs the wandb package"),
    "Ray Train V1": (["data.path=memory"], ["v1"], "RAY_TRAIN_V2_ENABLED='0': selects Ray Train V1"),
    "dashboard address": (["data.path=memory", "cluster.address=http://head:8265"], [], "job-server address"),
    "layout": (["parallelism.tp=3"], [], "parallelism.tp=3"),
    "unknown key": (["parallelism.dpp=2"], [], "parallelism.dpp"),
}


def _run(capsys, argv: list[str]) -> tuple[int | None, str, str]:
    try:
        code: int | None = cli.main(argv)
    except RayStarted:
        code = None
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.mark.parametrize("case", CASES)
def test_check_refuses_what_train_refuses_before_ray(case, tmp_path, capsys, monkeypatch):
    from raytrain_hybrid.launch.records.lease import acquire

    sets, extra, said = CASES[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(start, "join_ray", lambda *a, **k: (_ for _ in ()).throw(RayStarted()))
    d = tmp_path / "in"  # the case's files; the run's output goes beside it
    d.mkdir()
    files = {
        "d": d,
        "notpq": _file(d, "x.parquet") if "{notpq}" in str(sets) else None,
        "tokens": _tokens(d) if "{tokens}" in str(sets) or "tokens" in extra else None,
        "text": _text(d) if "{text}" in str(sets) else None,
        "rows": _rows(d) if "{rows}" in str(sets) else None,
        "ckpts": _manifest_run(d) if "{ckpts}" in str(sets) else None,
        "model": _no_weights(d) if "{model}" in str(sets) else None,
        "quantized": _quantized(d) if "{quantized}" in str(sets) else None,
        "quantized_text": _quantized(d, "text_config") if "{quantized_text}" in str(sets) else None,
        "quantized_silent": _quantized(d, "nowhere") if "{quantized_silent}" in str(sets) else None,
        "adapter": _adapter(d) if "{adapter}" in str(sets) else None,
        "adapter_with_config": _adapter(d, with_config=True) if "{adapter_with_config}" in str(sets) else None,
    }
    if "{empty}" in str(sets):
        pq.write_table(TOKENS.slice(0, 0), d / "empty.parquet")
        files["empty"] = d / "empty.parquet"
    if "broken" in extra:
        _file(d, "part-9.parquet", b"PAR1 this is not parquet")
    if "v1" in extra:
        monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "0")
    if not any(s.startswith("run.output_dir=") for s in sets):
        sets = [*sets, f"run.output_dir={tmp_path / 'run'}"]
    sets = [s.format(**files) for s in [*TINY, *sets]]
    argv = [a for s in sets for a in ("--set", s)] + [a.format(**files) for a in extra if a.startswith("-")]
    argv += [a.format(**files) for i, a in enumerate(extra) if i and extra[i - 1] == "--resume"]
    holder = acquire(str(tmp_path / "run")) if "lease" in extra else None
    try:
        began = time.perf_counter()
        code, out, err = _run(capsys, ["check", *argv])
        took = time.perf_counter() - began
        assert code == 2 and said.format(**files) in err, (code, out, err)
        assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, the refusal
        train = _run(capsys, ["train", *argv])
    finally:
        if holder is not None:
            holder.release()
    assert train[0] == 2, train
    if "lease" in extra:  # the holder's age is said in seconds: the same but for that
        strip = lambda e: e.split("; renewed")[0]  # noqa: E731
        assert strip(train[2]) == strip(err), (train[2], err)
    else:
        assert train[2] == err, (train[2], err)
    assert took < 3, f"check took {took:.1f} s"  # 0.01-0.05 s here after the suite's imports
    assert not (tmp_path / "run").exists() or "lease" in extra, "a refused run left its output directory"


def test_a_crowded_machine_is_said_by_check_and_by_train_before_ray(tmp_path, capsys, monkeypatch):
    """Far more workers than cores: a warning with the fix, by both, before Ray starts."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(start, "join_ray", lambda *a, **k: (_ for _ in ()).throw(RayStarted()))
    if "ray" in sys.modules:  # a local run, as from a shell: not the Ray this test process may have joined
        monkeypatch.setattr(sys.modules["ray"], "is_initialized", lambda: False)
    sets = ["parallelism.dp=4", "data.path=memory", f"run.output_dir={tmp_path / 'run'}"]
    argv = [a for s in sets for a in ("--set", s)]
    code, out, _ = _run(capsys, ["check", *argv])
    (line,) = [x for x in out.splitlines() if x.startswith("warning: 16 workers")]
    assert code == 0 and "2 CPU cores" in line and "--set parallelism.dp=1" in line, out
    code, out, _ = _run(capsys, ["train", *argv])
    assert code is None and line in out.splitlines(), out  # said, then Ray would start
    # The run plan is derived and said before Ray starts, as check prints it (launch.runtime.start.plan_run).
    (start_line,) = [x for x in out.splitlines() if x.startswith("start: ")]
    assert start_line.startswith("start: dp=4 tp=2 pp=2, 16 workers (1 CPU each) on nodes holding [16]"), out
    code, out, _ = _run(capsys, ["check", *argv[:-2], "--set", "parallelism.dp=2", *argv[-2:]])
    assert code == 0 and "warning: " not in out
