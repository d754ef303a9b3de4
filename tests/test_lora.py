"""LoRA (``[lora]``) on a pretrained Llama in every layout, against peft.

The checkpoint is a tiny LlamaForCausalLM written by transformers' ``save_pretrained`` here
(tests/test_pretrained.make_checkpoint). The oracle is tests/reference_lora.py: peft's
adapters on the unmodified transformers model in one process.

- layouts (TP with and without sequence parallelism, PP, ZeRO-1, FSDP, in one launch of gloo
  processes) equal the reference: every loss, the global gradient norm, every adapter's
  gradient norm, the final adapters; the base weights are unchanged and have no optimizer
  state; with lora.dropout too (the reference applies the engine's documented mask rule);
- refusals before anything starts name the key.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_pretrained import make_checkpoint

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

SEQ, STEPS = 32, 2
LORA = ["lora.rank=4", "lora.alpha=8", "lora.targets=all-linear"]
LAYOUTS = {  # four ranks each: TP with SP and PP; FSDP and PP; CP and FSDP
    "1x2x2-sp": ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2"],
    "2x1x2-zero3": ["parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=2", "parallelism.zero=3"],
    # Context parallelism 2 with FSDP over dp x cp, as jobs/lora_llama31_8b_64k.toml runs it.
    "dp2-cp2-zero3": [
        "parallelism.dp=2",
        "parallelism.cp=2",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.zero=3",
    ],
}
# lora.dropout > 0: every layout drops the elements the single process (the peft reference) drops.
# TP with SP and dp (tp ranks share a replicated input, the row-wise adapters' inputs are feature
# shards, dp ranks hold other rows), cp with PP (sequence slices, microbatches crossing stages),
# both recomputing their blocks in backward (the masks drawn again there).
DROPOUT = ["lora.dropout=0.25", "parallelism.activation_checkpointing=true"]
DROPOUT_LAYOUTS = {
    "dropout-dp2-tp2-sp": ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=1"],
    "dropout-cp2-pp2": ["parallelism.dp=1", "parallelism.cp=2", "parallelism.tp=1", "parallelism.pp=2"],
}
# The run resumed from 1x2x2-sp's step 1: TP, ZeRO-1 and recomputation.
RESUMED = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=1", "parallelism.zero=1"]
RESUMED += ["parallelism.activation_checkpointing=true"]
RTOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("lora-hf"), "llama")


def common(src, *extra) -> list[str]:
    return [
        f"model.pretrained={src}", "data.path=memory", f"model.seq_len={SEQ}", f"train.steps={STEPS}",
        "train.global_batch_size=8", "train.lr=1e-2", "parallelism.microbatches=2", *LORA, *extra,
    ]  # fmt: skip


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def lora_mismatches(result: dict, reference: list[dict], first: int = 0) -> list[str]:
    """Every way a run (from step ``first``: a resumed one) differs from the peft reference: the
    initial state, every loss, global and per-adapter gradient norm, the final adapters, and a
    base equal to transformers' load of the checkpoint, with no gradient."""
    history, probe = result["history"], result["probe"]
    bad = []
    start = reference[0]["initial"]
    if sorted(probe["initial"]) != sorted(start):
        return [f"parameter names differ: {sorted(set(probe['initial']) ^ set(start))[:8]}"]
    if not first:
        bad += [f"initial value of {n}" for n, v in start.items() if not np.array_equal(probe["initial"][n], v.numpy())]
    assert [h["step"] for h in history] == list(range(first, len(reference))) and len(probe["grad_norms"]) == len(
        history
    )
    for got, norms, want in zip(history, probe["grad_norms"], reference[first:], strict=True):
        for key in ("loss", "grad_norm", "lr"):
            if abs(got[key] - want[key]) > RTOL * abs(want[key]) + 1e-12:
                bad.append(f"{key} at step {want['step']}: {got[key]!r}, want {want[key]!r}")
        floor = 1e-8 * want["grad_norm"]
        for name, w in want["grad_norms"].items():
            if abs(norms[name] - w) > RTOL * w and max(norms[name], w) > floor:
                bad.append(f"gradient norm of {name} at step {want['step']}: {norms[name]!r}, want {w!r}")
        frozen = [n for n, g in norms.items() if n not in want["grad_norms"] and g != 0]
        bad += [f"frozen {n} has a gradient at step {want['step']}" for n in frozen]
    for name, w in reference[-1]["params"].items():
        got = probe["final"][name]
        if name in reference[0]["grad_norms"]:  # an adapter: trained
            if _rel(got, w.numpy()) > RTOL:
                bad.append(f"final value of {name}: differs by {_rel(got, w.numpy()):.2e} of its norm")
        elif not np.array_equal(got, w.numpy()):
            bad.append(f"frozen {name} is not the checkpoint's")
    return bad


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory) -> dict:
    """One launch of four gloo ranks: the three layouts (the first saving checkpoints), a run
    resumed from that one's step 1 under another layout, the dropout layouts, and a bf16-base run
    under FSDP with its untrained twin."""
    from gloo_harness import run_gloo_jobs

    out = tmp_path_factory.mktemp("lora-runs")
    jobs: dict = {name: common(llama, *layout, f"run.output_dir={out / name}") for name, layout in LAYOUTS.items()}
    jobs["1x2x2-sp"] += ["checkpoint.interval=1"]
    jobs["resumed"] = {
        "overrides": common(llama, *RESUMED, f"run.output_dir={out / 'resumed'}"),
        "resume": str(out / "1x2x2-sp" / "checkpoints" / "step_1"),
    }
    for name, layout in DROPOUT_LAYOUTS.items():
        jobs[name] = common(
            llama, *DROPOUT, *layout, "parallelism.sequence_parallel=true", f"run.output_dir={out / name}"
        )
    # The bf16 base, over BF16_STEPS, and its negative control: the same run with an untrained adapter.
    bf16 = [*LAYOUTS["2x1x2-zero3"], "train.dtype=bfloat16", f"train.steps={BF16_STEPS}"]
    jobs["bf16"] = common(llama, *bf16, f"run.output_dir={out / 'bf16'}")
    jobs["bf16-untrained"] = common(llama, *bf16, "train.lr=1e-12", f"run.output_dir={out / 'bf16-untrained'}")
    return {"out": out, **run_gloo_jobs(4, jobs)}


@pytest.fixture(scope="module")
def reference(runs, llama) -> list[dict]:
    from reference_lora import lora_reference_run

    return lora_reference_run(load_config(None, common(llama)), str(llama), runs["1x2x2-sp"]["probe"]["initial"])


@pytest.fixture(scope="module")
def reference_dropout(runs, llama) -> list[dict]:
    from reference_lora import lora_reference_run

    cfg = load_config(None, common(llama, "lora.dropout=0.25"))
    return lora_reference_run(cfg, str(llama), runs["1x2x2-sp"]["probe"]["initial"])


def test_dropout_equals_peft_in_every_layout(runs, reference, reference_dropout):
    """lora.dropout=0.25 under dp x tp (SP) and cp x pp, with recomputation: each layout equals
    peft's single process with the same masks (models.lora_dropout's rule), which differs from
    the run without dropout."""
    assert reference_dropout[1]["loss"] != reference[1]["loss"]  # (step 0's too, but B starts at 0)
    assert any(abs(reference_dropout[0]["grad_norms"][n] - w) > 1e-3 * w for n, w in reference[0]["grad_norms"].items())
    for name in DROPOUT_LAYOUTS:
        bad = lora_mismatches(runs[name], reference_dropout)
        assert not bad, f"{name}: {len(bad)} mismatches:\n" + "\n".join(bad[:20])


def test_dropout_mask_by_position():
    """The mask is a function of global coordinates: a slice's mask is the slice of the whole's,
    about 1 - p of the elements are kept, and another step or linear draws another mask."""
    from raytrain_hybrid.models.lora_dropout import keep_mask, step_key

    def ar(a, b):
        return torch.arange(a, b)

    key = step_key(0, "model.layers.0.self_attn.q_proj", 3)
    whole = keep_mask(key, ar(0, 4), ar(0, 64), ar(0, 96), 64, 96, 0.25)
    part = keep_mask(key, ar(2, 4), ar(32, 64), ar(48, 96), 64, 96, 0.25)
    assert torch.equal(part, whole[2:, 32:, 48:])
    assert abs(whole.float().mean().item() - 0.75) < 0.01
    other = keep_mask(step_key(0, "model.layers.0.self_attn.q_proj", 4), ar(0, 4), ar(0, 64), ar(0, 96), 64, 96, 0.25)
    assert abs((whole == other).float().mean().item() - (0.75**2 + 0.25**2)) < 0.01  # independent masks


def test_every_layout_equals_peft(runs, reference):
    """TP with SP and PP, TP with ZeRO-1, FSDP with PP, CP with FSDP: each equals peft's single-process training."""
    adapters = set(reference[0]["grad_norms"])
    assert len(adapters) == 2 * 7 * 4, sorted(adapters)[:4]  # A and B on 7 linears in 4 blocks
    assert all(reference[-1]["params"][n].abs().max() > 0 for n in adapters)  # B starts at 0: trained
    for name in [*LAYOUTS, "resumed"]:
        bad = lora_mismatches(runs[name], reference, first=1 if name == "resumed" else 0)
        assert not bad, f"{name}: {len(bad)} mismatches:\n" + "\n".join(bad[:20])
        for rank in runs[name]["memory"]:
            opt, params = rank["optimizer_bytes"], rank["param_bytes"]
            assert 0 < opt < params / 4, (name, rank)  # adapters' moments only, never the base's


# The bf16 base against peft's fp32 run of BF16_STEPS. Measured: a trained bf16 run's losses within
# 3.3e-4 of the reference's and its adapters' updates within 0.11 of the reference's; an untrained
# one (lr 1e-12) differs by 1.5e-3 at step 1, 2.1e-3 at step 2 and 1.1e-2 at step 4, its update
# by 1.0 (it has none). At two steps the untrained loss was within 8.3e-4 of the trained one.
BF16_STEPS, BF16_LOSS, BF16_UPDATE = 6, 1e-3, 0.3


def bf16_mismatches(result: dict, reference: list[dict]) -> list[str]:
    """Where a bf16-base run is beyond bf16's reach of the fp32 reference: a loss (BF16_LOSS relative),
    or all the adapters' update over the run, final minus initial (BF16_UPDATE of the reference's)."""
    bad = []
    for got, want in zip(result["history"], reference, strict=True):
        if abs(got["loss"] - want["loss"]) > BF16_LOSS * abs(want["loss"]):
            bad.append(f"loss at step {want['step']}: {got['loss']!r}, want {want['loss']!r}")
    names = sorted(reference[0]["grad_norms"])  # the adapters
    probe = result["probe"]
    start = np.concatenate([np.ravel(probe["initial"][n]) for n in names])
    got = np.concatenate([np.ravel(probe["final"][n]) for n in names]) - start
    want = np.concatenate([reference[-1]["params"][n].numpy().ravel() for n in names]) - start
    if _rel(got, want) > BF16_UPDATE:
        bad.append(f"the adapters' update differs by {_rel(got, want):.2e} of the reference's")
    return bad


def test_bf16_base(runs, llama):
    """A bf16 base (fp32 adapters) under FSDP: half the base's bytes, and over six steps the
    training peft does in fp32, within bf16's reach; the same run with an untrained adapter
    (lr 1e-12) is beyond that reach, so the bound tells training from none."""
    from reference_lora import lora_reference_run

    half, whole = runs["bf16"], runs["2x1x2-zero3"]
    assert half["memory"][0]["param_bytes"] < 0.55 * whole["memory"][0]["param_bytes"]
    cfg = load_config(None, common(llama, f"train.steps={BF16_STEPS}"))
    reference = lora_reference_run(cfg, str(llama), half["probe"]["initial"])
    assert len(half["history"]) == BF16_STEPS
    bad = bf16_mismatches(half, reference)
    assert not bad, "\n".join(bad)
    untrained = bf16_mismatches(runs["bf16-untrained"], reference)
    assert any(b.startswith("loss at step") for b in untrained), untrained
    assert any(b.startswith("the adapters' update") for b in untrained), untrained


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        (["lora.rank=4", "model.pretrained="], "lora.rank", ["model.pretrained"]),
        (["lora.rank=4", "lora.targets=qkv"], "lora.targets", ["'qkv'", "q_proj", "all-linear"]),
        (["lora.rank=-1"], "lora.rank", ["-1", ">= 0"]),
        (["lora.alpha=0"], "lora.alpha", ["> 0"]),
        (["lora.dropout=1.0"], "lora.dropout", ["[0, 1)"]),
    ],
)
def test_refusals_name_the_key(llama, extra, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.pretrained={llama}", *extra])
    assert info.value.key == key
    assert all(w in str(info.value) for w in words), str(info.value)


def test_lora_on_a_mixture_of_experts_is_refused():
    moe = Path(__file__).parent / "assets" / "Qwen3-30B-A3B"
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.pretrained={moe}", "lora.rank=8"])
    assert (
        info.value.key == "lora.rank" and "mixture of experts" in str(info.value) and "lora.rank=0" in str(info.value)
    )


def test_frozen_base_is_not_trained_single_process(llama):
    """Sanity without a process group: only the adapters require gradients."""
    from raytrain_hybrid.models import get_arch, lora
    from raytrain_hybrid.models.common import build_stage

    cfg = load_config(None, common(llama))
    spec = get_arch(cfg.model.arch)
    stage = build_stage(spec, spec.hf_config(cfg), [0, 1, 2, 3], first=True, last=True)
    lora.inject(stage, spec, cfg.lora)
    trained = sorted(n for n, p in stage.named_parameters() if p.requires_grad)
    assert trained and all(lora.is_adapter(n) for n in trained)
    assert torch.Size([4, 64]) in {p.shape for n, p in stage.named_parameters() if ".lora_A." in n}


def _logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.numpy()


def test_resume_export_and_merge(runs, llama, tmp_path, capsys):
    """A LoRA run checkpoints its adapters and their AdamW state only (resumed under another
    layout it continues the run as peft does: test_every_layout_equals_peft); a resume that
    changes a lora key is refused naming it. ``export`` writes a PEFT adapter directory that
    ``PeftModel.from_pretrained`` puts on the base to give the trained model's logits, and
    ``export --merge`` full weights that transformers loads alone, with the same logits."""
    from peft import PeftModel
    from reference_lora import peft_model
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.checkpoint.reader import parse_metadata
    from raytrain_hybrid.cli import main as cli

    full = runs["out"] / "1x2x2-sp"
    step1 = full / "checkpoints" / "step_1"
    md = parse_metadata((step1 / ".metadata").read_bytes())
    keys = [k for k in md.state_dict_metadata if k.startswith(("model.", "optimizer."))]
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]  # no base weight, no base state
    assert len([k for k in keys if k.startswith("optimizer.")]) == 3 * len([k for k in keys if k.startswith("model.")])

    run = common(llama)
    cfg_line = [*run, f"run.output_dir={tmp_path / 'again'}", "train.steps=6"]
    for change, key in (("lora.rank=8", "lora.rank"), ("lora.targets=q_proj", "lora.targets")):
        sets = [x for s in [*cfg_line, change] for x in ("--set", s)]
        assert cli(["train", "--resume", str(step1), *sets]) == 2
        err = capsys.readouterr().err
        assert f"{key}=" in err and "was written for" in err, err

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert cli(["export", str(full), str(adapter)]) == 0
    assert cli(["export", "--merge", str(full), str(merged)]) == 0
    import raytrain_hybrid as rh  # the public API's export is the CLI's, merge included

    assert rh.export(full, tmp_path / "merged-api", merge=True) == str(tmp_path / "merged-api")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "merged-api" / name).read_bytes() == (merged / name).read_bytes(), name
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}

    cfg = load_config(None, run)
    trained = peft_model(cfg, str(llama))  # transformers + peft holding the engine's trained adapters
    named = {n.removeprefix("base_model.model."): p for n, p in trained.named_parameters()}
    with torch.no_grad():
        for name, value in runs["1x2x2-sp"]["probe"]["final"].items():
            named[name].copy_(torch.as_tensor(value))
    ids = torch.randint(0, 4096, (4, SEQ), generator=torch.Generator().manual_seed(7))
    want = _logits(trained, ids)
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32, local_files_only=True)
    assert _rel(_logits(base, ids), want) > 1e-4  # training moved them
    loaded = PeftModel.from_pretrained(base, str(adapter))
    assert _rel(_logits(loaded, ids), want) <= 1e-5
    alone = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, local_files_only=True)
    assert not any("lora" in n for n, _ in alone.named_parameters())
    assert _rel(_logits(alone, ids), want) <= 1e-5


def test_plan_fits_a_70b_lora_on_fewer_gpus(tmp_path, capsys):
    """The planner counts LoRA's memory (a frozen bf16 base: its weights only; gradients and
    AdamW state for the adapters): a 70B Llama (its config.json alone) fits 4 H100s with LoRA,
    while a full fine-tune does not fit 8."""
    import json

    from raytrain_hybrid.cli import main as cli

    src = tmp_path / "llama-70b"
    src.mkdir()
    conf = {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }  # fmt: skip
    (src / "config.json").write_text(json.dumps(conf))
    sets = [f"model.pretrained={src}", "model.seq_len=4096", "train.dtype=bfloat16", "train.global_batch_size=64"]

    def fits(world: int, *extra: str) -> bool:
        argv = ["plan", "--world-size", str(world), "--gpus-per-node", "8", "--top", "1", "--json"]
        assert cli([*argv, *(x for s in [*sets, *extra] for x in ("--set", s))]) == 0
        (best,) = json.loads(capsys.readouterr().out)
        return best["feasible"]

    lora = ("lora.rank=16", "lora.targets=all-linear")
    assert fits(4, *lora) and not fits(8)
