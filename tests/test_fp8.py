"""train.fp8: which linears become float8, where FP8 is refused, and (emulated on CPU, as
train.fp8_emulate documents) a pipeline, an FSDP2 and a tensor-parallel layout that train within
the FP8 bound of the float32 run, save, resume under another layout, and export float32 weights."""

from __future__ import annotations

import json

import pytest
import torch
from gloo_harness import run_gloo_jobs

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

STEPS = ("train.steps=4", "model.num_layers=2", "train.global_batch_size=4", "model.seq_len=32")
PP2 = ("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2", "parallelism.microbatches=2")
FSDP2 = ("parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1", "parallelism.zero=3")
TP2 = ("parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1")
ONE = ("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1")
# Emulated float8 (e4m3 forward, a 3-bit mantissa) against float32 over 4 steps of the tiny model:
# seen 0.05 % apart; a run whose linears silently stayed fp32 would be exactly equal.
FP8_BOUND = 2e-3


def _cfg(*sets: str):
    return load_config(None, [*STEPS, *ONE, *sets])


def test_the_blocks_linears_convert_and_check_says_which_stay():
    """Every linear of the blocks whose dimensions are multiples of 16 becomes a Float8Linear;
    the head (outside the blocks) and the MLP (ffn 200, not a multiple of 16) stay, as check says."""
    from torchao.float8.float8_linear import Float8Linear

    from raytrain_hybrid.distributed.fp8 import apply_fp8, describe_fp8
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    cfg = _cfg("train.fp8=rowwise", "train.fp8_emulate=true", "model.ffn_hidden_size=200")
    spec = get_arch(cfg.model.arch)
    stage = build_stage(spec, spec.hf_config(cfg), [0, 1], first=True, last=True)
    names = dict(stage.named_parameters())
    apply_fp8(stage, spec, "rowwise", emulate=True)
    fp8 = sorted(n for n, m in stage.named_modules() if isinstance(m, Float8Linear))
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert fp8 == sorted(f"{spec.layers}.{i}.self_attn.{p}" for i in (0, 1) for p in attn), fp8
    assert dict(stage.named_parameters()).keys() == names.keys()  # checkpoints keep their names
    said = describe_fp8(cfg)
    assert said.startswith("fp8 rowwise (emulated): 4 linears a block in float8 (self_attn.q_proj"), said
    assert "model.layers.N.mlp.down_proj stays in float32: dimensions 200x128 are not multiples of 16" in said, said
    assert "lm_head stays in float32: outside the transformer blocks" in said, said


@pytest.mark.parametrize(
    "sets, key, words",
    [
        (("parallelism.tp=2", "train.fp8=tensorwise"), "train.fp8", "tensor parallelism"),
        (("cluster.use_gpu=false", "train.fp8=tensorwise"), "train.fp8", "train.fp8_emulate=true"),
        (("train.fp8_emulate=true",), "train.fp8_emulate", 'which is "off"'),
    ],
)
def test_refused_naming_the_key(sets, key, words):
    from raytrain_hybrid.config import validate

    with pytest.raises(ConfigError) as err:
        validate(_cfg(*sets))
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_a_cpu_worker_refuses_real_fp8():
    from raytrain_hybrid.distributed.fp8 import require_fp8_device

    with pytest.raises(ConfigError, match=r"train\.fp8.*compute capability >= 8\.9.*on cpu"):
        require_fp8_device("rowwise", False, torch.device("cpu"))
    require_fp8_device("rowwise", True, torch.device("cpu"))  # emulated: any device


def test_emulated_fp8_trains_saves_resumes_and_exports_fp32(tmp_path):
    from safetensors.torch import load_file

    from raytrain_hybrid.checkpoint.export import export_hf, load_full_state_dict

    saved = tmp_path / "fp8"
    fp8 = ("train.fp8=rowwise", "train.fp8_emulate=true")
    jobs = {
        "fp32": [*STEPS, *PP2],
        "fp8": [*STEPS, *PP2, *fp8, "checkpoint.interval=2", f"run.output_dir={saved}"],
        "tensorwise": [*STEPS, *FSDP2, "train.fp8=tensorwise", "train.fp8_emulate=true"],
        "fp32_fsdp": [*STEPS, *FSDP2],
        "rowwise_tp2": [*STEPS, *TP2, *fp8],
        "resumed": {
            "overrides": [*STEPS, *FSDP2, *fp8, f"run.output_dir={tmp_path / 'resumed'}"],
            "resume": str(saved / "checkpoints" / "step_2"),
        },
    }
    out = run_gloo_jobs(2, jobs)
    loss = {name: [h["loss"] for h in r["history"]] for name, r in out.items()}
    for got, want in (("fp8", "fp32"), ("tensorwise", "fp32_fsdp")):
        gaps = [abs(a - b) / b for a, b in zip(loss[got], loss[want], strict=True)]
        assert max(gaps) <= FP8_BOUND and max(gaps) > 0, (got, gaps)
    # Tensor parallel (sequence parallel on) against the pipeline run, both rowwise: the first steps
    # agree to 1e-5 (fp32 is 4e-5 away at step 1); float8's rounding then lets them drift to ~1e-4.
    tp2 = loss["rowwise_tp2"]
    assert tp2[:3] == pytest.approx(loss["fp8"][:3], rel=1e-5) and tp2 == pytest.approx(loss["fp8"], rel=1e-3), tp2
    # Resumed from step 2 under FSDP2: steps 3 and 4 of the uninterrupted pipeline run.
    assert [h["step"] for h in out["resumed"]["history"]] == [2, 3]
    assert loss["resumed"] == pytest.approx(loss["fp8"][2:], rel=1e-4)

    step4 = saved / "checkpoints" / "step_4"
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert manifest["config"]["train"]["fp8"] == "rowwise"
    cfg = load_config(None, [*STEPS, *PP2, *fp8])
    weights = load_full_state_dict(step4, cfg)
    export_hf(step4, tmp_path / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert exported[q].dtype == torch.float32 and torch.equal(exported[q], weights[q])
