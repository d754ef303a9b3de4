"""Any Hugging Face decoder, family by family, held to the oracle.

Each family is a tiny checkpoint written here by transformers' own ``save_pretrained`` (random
weights, 4 layers, grouped-query attention, a sliding window of 8 where the family has one, its
default tying of embeddings), given to the engine as ``model.pretrained`` alone: the
architecture comes from its config.json. Per family, in fp32 against tests/reference.py's
plain loop over transformers' own model loaded from the same directory (eager attention):

- (1,1,1): every family's run in one single-rank launch;
- dp=2 x tp=2 x pp=2 (1F1B, ZeRO-0): every family's run in one 8-rank launch (dp=4 x tp=2 x pp=1
  for a family transformers gives no pipeline plan; dp=8 for LFM2, whose plan shards no layer);

each with the losses, the global and every parameter's gradient norm, and the final weights.
Export writes the source's key names and config.json, and transformers loads it as the same class.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

VOCAB, SEQ = 4096, 32  # the shipped tokenizer's 4096 ids
# Families of the matrix that the generic path trains (Llama, GPT-2 and the MoE specs keep their
# hand-written specs and their own oracle tests; Mistral and Qwen2, generic too, are held by the model
# matrix and by test_pretrained.py's checkpoints).
FAMILIES = (
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "smollm3",
    "starcoder2",
    "glm4",
    "cohere2",
    "ministral",
    "nemotron",  # no pipeline plan (pp=1), a non-gated squared-ReLU MLP, LayerNorm with a +1 scale
    "lfm2",  # no pipeline plan, short-convolution layers beside attention, its final norm named otherwise
    "qwen2_moe",  # a mixture of experts with a gated shared expert, whole on every tp rank
)
# Families without a pipeline plan in transformers, trained at pp=1: their 3-D job is dp=4 x tp=2, or
# dp=8 where the tensor-parallel plan has no entry for the layers (tp > 1 is refused).
NO_PIPELINE_PLAN = ("nemotron", "lfm2")
NO_LAYER_TP = ("lfm2",)
COMMON = ("data.path=memory", f"model.seq_len={SEQ}", "train.steps=3", "train.global_batch_size=8", "train.lr=1e-3")
SINGLE = ("parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1")
THREE_D = ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=2")
DP_TP = ("parallelism.dp=4", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1")
DP_ONLY = ("parallelism.dp=8", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1")


# Latent attention's widths, a mixture of experts' sizes and a partial rotary slice, where the
# family has them, shrunk from its full-size defaults (256 experts, 512-wide latents) to a tiny model's.
TINY_EXTRAS = {
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts": 8,
    "num_local_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "rotary_dim": 8,  # CodeGen, GPT-J: a rotated slice of each head, 64 wide by default
    # Gemma 4's per-layer embeddings: 262,144 ids x 256 a layer by default (1 GB at 4 layers).
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
}


# Families whose tiny model would hold one kind of layer only (LFM2 makes every layer attention unless
# told which are convolutions, as its checkpoints do): each kind, alternating.
TINY_LAYER_TYPES = {mt: ["conv", "full_attention", "conv", "full_attention"] for mt in ("lfm2", "lfm2_moe")}


def tiny_sizes(model_type: str, vocab: int = VOCAB) -> dict:
    """The config keywords of a tiny ``model_type`` (a few layers, grouped-query attention)."""
    from transformers import AutoConfig

    sizes = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.1,
    }
    if model_type in TINY_LAYER_TYPES:
        sizes["layer_types"] = TINY_LAYER_TYPES[model_type]
    defaults = AutoConfig.for_model(model_type)
    for key, tiny in TINY_EXTRAS.items():
        value = getattr(defaults, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > tiny:
            sizes[key] = tiny
    # Families whose defaults leave the routed experts (dots1) or their top-k (DeepSeek-V2) unset.
    counts = ("n_routed_experts", "num_experts", "num_local_experts")
    if getattr(defaults, "moe_intermediate_size", None) and not any(getattr(defaults, k, None) for k in counts):
        sizes.update({k: TINY_EXTRAS[k] for k in counts if hasattr(defaults, k)})
        if hasattr(defaults, "n_shared_experts") and defaults.n_shared_experts is None:
            sizes["n_shared_experts"] = 1
    if getattr(defaults, "num_experts_per_tok", 0) is None and any(sizes.get(k) for k in counts):
        sizes["num_experts_per_tok"] = TINY_EXTRAS["num_experts_per_tok"]
    return sizes


def make_checkpoint(root: Path, model_type: str, vocab: int = VOCAB) -> Path:
    """A tiny checkpoint of ``model_type`` written by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, model_type)))
    sizes = tiny_sizes(model_type, vocab)
    # A family whose own defaults disagree with these sizes (latent attention: as many key/value
    # heads as heads; per-layer head widths) gets the first variant transformers itself can run.
    variants = [{}, {"head_dim": None}, {"num_key_value_heads": 4}, {"head_dim": None, "num_key_value_heads": 4}]
    if "qk_rope_head_dim" in sizes:  # latent attention whose rotary tables are head_dim wide (LongCat)
        variants.append({"head_dim": sizes["qk_rope_head_dim"], "num_key_value_heads": 4})
    for i, change in enumerate(variants):
        kwargs = {k: v for k, v in {**sizes, **change}.items() if v is not None}
        try:
            config = AutoConfig.for_model(model_type, **kwargs)
            if getattr(config, "sliding_window", None):
                config.sliding_window = 8  # shorter than the rows: the window decides what attends
            # eager: the reference's attention, which (unlike SDPA) refuses mismatched key/value heads
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            with torch.no_grad():
                model(input_ids=torch.randint(3, vocab, (1, 16)))
            break
        except Exception:
            if i == len(variants) - 1:
                raise
    out = root / model_type
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The families' checkpoints, and a model of our own (tests/custom_model.py) registered with
    register_model, under "custom"."""
    from custom_model import TinyDecoderConfig, TinyDecoderForCausalLM

    import raytrain_hybrid as rh

    root = tmp_path_factory.mktemp("families")
    out = {mt: make_checkpoint(root, mt) for mt in FAMILIES}
    assert rh.register_model(TinyDecoderConfig, TinyDecoderForCausalLM) == "rh_tiny_decoder"
    out["custom"] = make_checkpoint(root, "rh_tiny_decoder")
    return out


def _jobs(checkpoints: dict, layout) -> dict:
    """Every checkpoint's run at ``layout``; the custom model's registered again in each rank."""
    from raytrain_hybrid.models.custom import registered

    jobs: dict = {
        mt: _overrides(path, _three_d(mt) if layout == THREE_D else layout) for mt, path in checkpoints.items()
    }
    jobs["custom"] = {"overrides": jobs["custom"], "register": registered()}
    return jobs


def _three_d(mt: str) -> tuple[str, ...]:
    return DP_ONLY if mt in NO_LAYER_TP else DP_TP if mt in NO_PIPELINE_PLAN else THREE_D


def _overrides(path: Path, layout) -> list[str]:
    return [f"model.pretrained={path}", *COMMON, *layout]


@pytest.fixture(scope="module")
def references(checkpoints):
    from conftest import reference_history  # noqa: F401 - the session's reference cache lives there
    from reference import reference_run
    from transformers import AutoModelForCausalLM

    out = {}
    for mt, path in checkpoints.items():
        cfg = load_config(None, _overrides(path, SINGLE))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        start = {n: v.detach().clone() for n, v in hf.state_dict().items()}  # transformers' load, not ours
        out[mt] = reference_run(cfg, initial=start)
        if mt == "qwen2_moe":  # (and with its router's auxiliary loss: test_the_router_loss_...)
            out[f"{mt}-aux"] = reference_run(cfg, initial=start, aux=ROUTER_AUX)
    return out


@pytest.fixture(scope="module")
def single_runs(checkpoints):
    from gloo_harness import run_gloo_jobs

    jobs = _jobs(checkpoints, SINGLE)
    # (with activation checkpointing: the wrapper it puts around each block renames the block's modules)
    jobs["qwen2_moe-aux"] = [
        *_overrides(_aux_checkpoint(checkpoints["qwen2_moe"]), SINGLE),
        "parallelism.activation_checkpointing=true",
    ]
    return run_gloo_jobs(1, jobs)


def _aux_checkpoint(source: Path) -> Path:
    """The Qwen2-MoE checkpoint with the router loss turned on in its config.json, as a Hub checkpoint
    trained with it says (output_router_logits, router_aux_loss_coef): taken with no key set."""
    import shutil

    copy = source.parent / f"{source.name}-aux-config"
    if not copy.exists():
        shutil.copytree(source, copy)
        conf = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(
            json.dumps(conf | {"output_router_logits": True, "router_aux_loss_coef": ROUTER_AUX})
        )
    return copy


# LoRA (peft's adapters on transformers' own linears) on two generic families, one of them tied with
# per-head norms and sliding layers, at dp=2 x tp=2 x pp=2 in the same launch.
LORA_FAMILIES = ("qwen3", "gemma3_text")
LORA = ("lora.rank=4", "lora.alpha=8", "lora.targets=all-linear", "train.lr=1e-2")


# Context parallelism (cp=2 beside tp=2 and pp=2) on a family with sliding layers, a tied head, per-head
# norms and its own attention scaling, in the same launch (an 8-rank job costs ~16 s of CPU; the plainer
# families are held at cp=2 by scripts/model_matrix.py --cp).
CP_FAMILIES = ("gemma3_text",)
CP_3D = ("parallelism.dp=1", "parallelism.cp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=2")
# Expert parallelism on a generic mixture of experts (Qwen2-MoE, with its shared expert): its experts
# split over the two dp ranks beside tp=2 (sequence parallelism on) and pp=2, in the same launch.
EP_3D = (*THREE_D, "parallelism.ep=2")
# ... and beside context parallelism under ZeRO-3: the experts' FSDP unit over the dp/ep x cp ranks.
EP_CP_ZERO3 = (
    *("parallelism.dp=2", "parallelism.cp=2", "parallelism.tp=1", "parallelism.pp=2", "parallelism.microbatches=2"),
    *("parallelism.ep=2", "parallelism.zero=3"),
)
# ... with the router's auxiliary loss (transformers' load_balancing_loss_func, models.generic_router)
# at a weight whose share of the loss the oracle's bound tells apart (the negative control shows it).
ROUTER_AUX = 0.1


@pytest.fixture(scope="module")
def three_d_runs(checkpoints):
    from gloo_harness import run_gloo_jobs

    jobs = _jobs(checkpoints, THREE_D)
    jobs |= {f"{mt}-lora": [*_overrides(checkpoints[mt], THREE_D), *LORA] for mt in LORA_FAMILIES}
    jobs |= {f"{mt}-cp": _overrides(checkpoints[mt], CP_3D) for mt in CP_FAMILIES}
    saved = ["checkpoint.interval=2", f"run.output_dir={_ep_run(checkpoints)}"]  # (resumed below)
    jobs["qwen2_moe-ep"] = [*_overrides(checkpoints["qwen2_moe"], EP_3D), *saved]
    aux = f"model.router_aux_loss_coef={ROUTER_AUX}"
    jobs["qwen2_moe-ep-cp-zero3-aux"] = [*_overrides(checkpoints["qwen2_moe"], EP_CP_ZERO3), aux]
    return run_gloo_jobs(8, jobs)


def test_the_architecture_comes_from_the_checkpoint(checkpoints):
    for mt, path in checkpoints.items():
        layout = ["parallelism.pp=1"] if mt in NO_PIPELINE_PLAN else []  # (the default layout's pp=2 is refused)
        layout += ["parallelism.tp=1"] if mt in NO_LAYER_TP else []  # (and its tp=2)
        cfg = load_config(None, [f"model.pretrained={path}", *layout])
        assert cfg.model.arch == (mt if mt != "custom" else "rh_tiny_decoder")


@pytest.mark.parametrize("layout", ["single", "3d"])
def test_a_model_of_our_own_trains_as_transformers_trains_it(layout, single_runs, three_d_runs, references):
    """register_model: the custom class, with its own TP plan, at (1,1,1) and dp=2 x tp=2 x pp=2."""
    _assert_oracle((single_runs if layout == "single" else three_d_runs)["custom"], references["custom"])


def test_register_model_refuses_what_workers_cannot_import():
    from transformers import LlamaConfig, LlamaForCausalLM

    import raytrain_hybrid as rh

    class Local(LlamaConfig):
        model_type = "rh_local"

    with pytest.raises(ConfigError, match="importable module"):
        rh.register_model(Local, LlamaForCausalLM)


def _assert_oracle(result: dict, reference: list[dict], first: int = 0) -> None:
    """tests/test_oracle.py's oracle, with the key biases held element by element. A key bias
    shifts every score of a query alike, so softmax ignores it, except where RoPE rotates it: in a
    family with partial rotary (GLM-4) the unrotated half of each head's bias has a zero gradient but
    for rounding, and in StarCoder2 single elements have near-zero ones; AdamW turns such rounding
    (the eager reference's, SDPA's) into full-size steps. So a key bias that misses the 1e-4 bound
    as a whole passes only if at least half its elements equal the reference's within 1e-4 of its
    norm and every other element stayed within AdamW's reach of its start (3 x the summed learning
    rates) in both runs. A fused query/key/value bias (GPT-NeoX's) holds a key bias: the same rule
    (its query and value elements are among those that must be equal). Every other parameter and
    check is the plain oracle's."""
    import re

    import numpy as np
    from test_oracle import oracle_mismatches

    reach = 3 * sum(r["lr"] for r in reference)
    bad = []
    for line in oracle_mismatches(result, reference, first):
        found = re.fullmatch(r"final value of (\S+\.(?:k_proj|query_key_value)\.bias): differs by .*", line)
        if found:
            name = found[1]
            w, g, i0 = (
                reference[-1]["params"][name].numpy(),
                result["probe"]["final"][name],
                result["probe"]["initial"][name],
            )
            same = np.abs(g - w) <= 1e-4 * np.linalg.norm(w)
            noise = (np.abs(g - i0) <= reach) & (np.abs(w - i0) <= reach)
            if (same | noise).all() and same.mean() >= 0.5:
                continue
        bad.append(line)
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:20])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_single_process_matches_transformers(model_type, single_runs, references):
    _assert_oracle(single_runs[model_type], references[model_type])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_dp_tp_pp_matches_transformers(model_type, three_d_runs, references):
    _assert_oracle(three_d_runs[model_type], references[model_type])


@pytest.mark.parametrize("model_type", CP_FAMILIES)
def test_context_parallel_generic_family_matches_transformers(model_type, three_d_runs, references):
    """cp=2 x tp=2 x pp=2: each rank attends from its half of every row over the whole row (the
    sliding layers' window and the causal mask built over the whole sequence), against the same
    one-process reference."""
    _assert_oracle(three_d_runs[f"{model_type}-cp"], references[model_type])


def test_expert_parallel_generic_family_matches_transformers(three_d_runs, references):
    """dp=2 x ep=2 x tp=2 x pp=2 on Qwen2-MoE: each dp rank holds half the experts of its stage's
    layers and sends each token to the rank holding its expert (distributed.expert_parallel), against
    the same one-process reference as every other layout."""
    _assert_oracle(three_d_runs["qwen2_moe-ep"], references["qwen2_moe"])


@pytest.mark.parametrize("layout", ["single", "ep-cp-zero3"])
def test_the_router_loss_of_a_generic_family_is_transformers_own(layout, single_runs, three_d_runs, references):
    """The router's auxiliary loss on Qwen2-MoE against the reference plus transformers' own
    load_balancing_loss_func on the model's router logits, per sequence and layer: in one process from
    a checkpoint whose config.json turns it on (output_router_logits, its router_aux_loss_coef; the suite's
    other Qwen2-MoE runs, whose config leaves it off, add none, as transformers adds none), with
    activation checkpointing, and with
    model.router_aux_loss_coef at dp=2 x ep=2 x cp=2 x pp=2 under ZeRO-3 (each cp rank routing its half
    of every sequence, the experts sharded over the ranks holding them). The negative control: the
    reference without it differs."""
    from test_oracle import oracle_mismatches

    run = single_runs["qwen2_moe-aux"] if layout == "single" else three_d_runs["qwen2_moe-ep-cp-zero3-aux"]
    _assert_oracle(run, references["qwen2_moe-aux"])
    assert oracle_mismatches(run, references["qwen2_moe"])
    first = run["history"][0]
    assert first["expert_load"] and first["dropped_tokens"] == 0
    # Reported apart, and part of the loss: at step 0 (the same weights) what the loss gains by it
    gained = references["qwen2_moe-aux"][0]["loss"] - references["qwen2_moe"][0]["loss"]
    assert gained > 0 and first["router_aux_loss"] == pytest.approx(gained, rel=1e-4)


def _ep_run(checkpoints: dict) -> Path:
    return checkpoints["qwen2_moe"].parent / "qwen2_moe-ep-run"


def test_an_expert_parallel_checkpoint_resumes_in_one_process_and_exports(
    checkpoints, three_d_runs, references, tmp_path
):
    """The ep run's checkpoint (each expert weight saved by the dp rank holding it) resumed by one
    process continues the reference's steps; its export loads in transformers as Qwen2-MoE with the
    source's config and key names, holding exactly the weights the ep run ended with."""
    import numpy as np
    from gloo_harness import run_gloo_jobs
    from transformers import AutoModelForCausalLM

    import raytrain_hybrid as rh

    run, source = _ep_run(checkpoints), checkpoints["qwen2_moe"]
    job = {"overrides": [*_overrides(source, SINGLE), f"run.output_dir={tmp_path / 'resumed'}"]}
    resumed = run_gloo_jobs(1, {"resumed": job | {"resume": str(run / "checkpoints" / "step_2")}})["resumed"]
    _assert_oracle(resumed, references["qwen2_moe"], first=2)
    rh.export(str(run), tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    assert _safetensors_keys(tmp_path / "hf") == _safetensors_keys(source)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, local_files_only=True)
    assert type(exported).__name__ == "Qwen2MoeForCausalLM"
    final = three_d_runs["qwen2_moe-ep"]["probe"]["final"]
    state = exported.state_dict()
    assert all(np.array_equal(state[name].numpy(), value) for name, value in final.items()), "export != the run's end"


def test_the_oracle_notices_a_wrong_family(checkpoints, single_runs, references):
    """A negative control: the same run against another family's reference fails."""
    from test_oracle import oracle_mismatches

    assert oracle_mismatches(single_runs["qwen3"], references["glm4"])


def test_a_family_transformers_has_no_decoder_plan_for_is_refused(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model("mamba", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    path = tmp_path / "mamba"
    config.save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="model_type 'mamba'"):
        load_config(None, [f"model.pretrained={path}"])


def test_check_refuses_an_unknown_arch_naming_the_key():
    with pytest.raises(ConfigError, match="model.arch"):
        load_config(None, ["model.arch=not_a_model"])


# Export, family by family: tied with per-head norms and sliding layers (Gemma 3), per-head query/key
# norms (Qwen3), fused projections in the files (Phi-3), norms over the whole projected width (OLMo 2),
# and a source whose config.json sets dropout, which training turns off (Seed-OSS).
EXPORT_FAMILIES = ("gemma3_text", "qwen3", "phi3", "olmo2", "seed_oss", "nemotron")


def _safetensors_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    return keys


def test_export_writes_the_source_names_and_loads_as_the_same_class(checkpoints, tmp_path):
    """Trained at a vanishing learning rate (one single-rank launch for every family), exported
    (the CLI for the first, rh.export for the others), loaded by transformers: the source's
    safetensors key names and config.json (every key), the same class, and the source's logits
    (1e-5)."""
    from gloo_harness import run_gloo_jobs
    from transformers import AutoModelForCausalLM

    import raytrain_hybrid as rh

    sources = {mt: checkpoints.get(mt) or make_checkpoint(tmp_path, mt) for mt in EXPORT_FAMILIES}
    jobs = {}
    for mt, src in sources.items():
        overrides = [o for o in _overrides(src, SINGLE) if not o.startswith("train.lr=")]
        jobs[mt] = [*overrides, "train.lr=1e-12", "checkpoint.interval=3", f"run.output_dir={tmp_path / mt}-run"]
    run_gloo_jobs(1, jobs)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    for mt, src in sources.items():
        exported = tmp_path / f"{mt}-hf"
        if mt == EXPORT_FAMILIES[0]:
            cli = str(Path(sys.executable).parent / "raytrain-hybrid")
            done = subprocess.run(
                [cli, "export", f"{tmp_path / mt}-run", str(exported)], capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr[-2000:]
        else:
            rh.export(f"{tmp_path / mt}-run", exported)
        want = json.loads((src / "config.json").read_text())
        got = json.loads((exported / "config.json").read_text())
        assert got == want, (mt, {k: (want.get(k), got.get(k)) for k in {*want, *got} if want.get(k) != got.get(k)})
        assert _safetensors_keys(exported) == _safetensors_keys(src), mt
        a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True).eval()
        b = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, local_files_only=True).eval()
        assert type(a) is type(b), mt
        with torch.no_grad():
            la, lb = a(input_ids=ids).logits, b(input_ids=ids).logits
        assert ((la - lb).norm() / la.norm()).item() <= 1e-5, mt
    assert json.loads((sources["seed_oss"] / "config.json").read_text())["residual_dropout"] > 0  # kept, not zeroed


def test_the_planner_counts_what_transformers_builds(checkpoints):
    """The planner's parameter count (models.params, from config.json alone) is transformers' own
    count of the model it builds, within 5 % (tied embeddings counted once, as transformers does)."""
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.models.params import param_count

    for mt, path in checkpoints.items():
        cfg = load_config(None, _overrides(path, SINGLE))
        want = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).num_parameters()
        got = param_count(cfg.model)
        assert abs(got - want) <= 0.05 * want, (mt, got, want)


def test_a_checkpoints_counts_read_off_its_headers_are_those_of_the_model_built(checkpoints):
    """The planner's counts of a checkpoint of a generic family come from its safetensors headers
    (no torch, no modeling code: models.generic_counts.from_headers): per block, embedding, the
    last stage's and the head's, and the tying, equal to those of the model transformers builds
    from its config on the meta device, for every family here (a tied one stores no head)."""
    from raytrain_hybrid.models import generic_counts

    for mt, path in checkpoints.items():
        if mt == "custom":  # (registered in this process: its classes answer, no recorded facts)
            continue
        m = {"pretrained": str(path), "pretrained_revision": ""}
        got = generic_counts.from_headers(mt, m)
        assert got is not None and got == generic_counts.built_counts(mt, m), (mt, got)


@pytest.mark.parametrize("model_type", LORA_FAMILIES)
def test_lora_on_a_generic_family_matches_peft(model_type, checkpoints, three_d_runs):
    """peft's single-process LoRA training of transformers' own model (tests/reference_lora.py) is
    what dp=2 x tp=2 x pp=2 trains: losses, adapters' gradient norms, final adapters, a frozen base."""
    import numpy as np
    from reference_lora import lora_reference_run
    from test_lora import lora_mismatches

    run = three_d_runs[f"{model_type}-lora"]
    path = checkpoints[model_type]
    probe = run["probe"]
    if "lm_head.weight" in probe["initial"] and json.loads((path / "config.json").read_text())["tie_word_embeddings"]:
        # A tied model's head is its embedding (peft's model names it once): the engine's copy of it
        # is frozen and equal to the embedding, at the start and at the end.
        embed = "model.embed_tokens.weight"
        for state in (probe["initial"], probe["final"]):
            assert np.array_equal(state.pop("lm_head.weight"), state[embed])
        for norms in probe["grad_norms"]:
            assert norms.pop("lm_head.weight", 0.0) == 0.0
    cfg = load_config(None, [*_overrides(path, SINGLE), *LORA])
    reference = lora_reference_run(cfg, str(path), probe["initial"])
    assert all(reference[-1]["params"][n].abs().max() > 0 for n in reference[0]["grad_norms"])  # trained
    bad = lora_mismatches(run, reference)
    assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:20])


def _stage_of(path: Path):
    """The engine's one-stage model of a checkpoint (every block), with transformers' weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    cfg = load_config(None, _overrides(path, SINGLE))
    spec = get_arch(cfg.model.arch)
    stage = build_stage(spec, spec.hf_config(cfg), list(range(cfg.model.num_layers)), True, True)
    buffers = [
        (m, n, b.clone()) for m in stage.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta
    ]
    stage.to_empty(device="cpu")
    for m, n, v in buffers:
        m._buffers[n] = v
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    state = reference.state_dict()
    names = [n for n, _ in stage.named_parameters()]
    set_model_state_dict(stage, {n: state[n] for n in names}, options=StateDictOptions(full_state_dict=True))
    return stage, reference


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "phi3"])
def test_a_packed_row_is_each_example_alone(model_type, checkpoints):
    """data.packing on a generic family: a row holding three examples (position ids restarting at
    each) gives every example the logits it has alone in transformers' model, sliding windows
    included (Gemma 2, Phi-3), and the loss's gradient is the examples' alone; without the position
    ids the later examples' logits differ (the comparison sees it)."""
    stage, reference = _stage_of(checkpoints[model_type])
    lengths = (7, 15, 10)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    logits = stage(ids, positions)
    starts = [0, 7, 22, 32]
    loss_alone = 0.0
    for a, b in zip(starts, starts[1:], strict=False):
        alone = reference(input_ids=ids[:, a:b]).logits
        torch.testing.assert_close(logits[:, a:b], alone, rtol=1e-5, atol=1e-5)
        loss_alone = loss_alone + torch.nn.functional.cross_entropy(alone[0, :-1], ids[0, a + 1 : b], reduction="sum")
    assert (stage(ids)[:, 22:] - logits[:, 22:]).abs().max() > 1e-3  # one causal row is another model
    loss = sum(
        torch.nn.functional.cross_entropy(logits[0, a : b - 1], ids[0, a + 1 : b], reduction="sum")
        for a, b in zip(starts, starts[1:], strict=False)
    )
    loss.backward()
    loss_alone.backward()
    ref = dict(reference.named_parameters())
    mine = {n: p.grad for n, p in stage.named_parameters()}
    if "lm_head.weight" not in ref:  # tied: one matrix, whose gradient is the engine's two summed (engine.tied)
        mine["model.embed_tokens.weight"] = mine["model.embed_tokens.weight"] + mine.pop("lm_head.weight")
    for name, grad in mine.items():
        want = ref[name].grad
        assert ((grad - want).norm() / want.norm()).item() <= 1e-4, name  # the oracle's 1e-4 of the norm


def test_a_fresh_process_registers_the_model_again_from_what_the_driver_recorded(checkpoints, tmp_path):
    """What a Ray Train worker does first (launch.runtime.entry): restore() the driver's registrations, by
    import path, in a process that never saw them; then the run's config, naming the model_type, loads."""
    from raytrain_hybrid.models.custom import registered

    entries = registered()
    assert ("custom_model", "TinyDecoderConfig", "custom_model", "TinyDecoderForCausalLM") in entries
    script = (
        "import json, sys\n"
        "from raytrain_hybrid.config import load_config\n"
        "from raytrain_hybrid.errors import ConfigError\n"
        "try:\n"
        "    load_config(None, ['model.arch=rh_tiny_decoder'])\n"
        "    sys.exit('loaded before any registration')\n"
        "except ConfigError:\n"
        "    pass\n"
        "from raytrain_hybrid.models.custom import restore\n"
        "restore(json.loads(sys.argv[1]))\n"
        "layout = ['parallelism.dp=1', 'parallelism.tp=2', 'parallelism.pp=2']\n"
        "cfg = load_config(None, ['model.arch=rh_tiny_decoder', *layout])\n"
        "print(cfg.model.arch)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(entries)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "rh_tiny_decoder"


def test_the_planner_predicts_the_state_each_family_holds(checkpoints, single_runs):
    """The planner's parameter, gradient and optimizer bytes for (1,1,1) are what the engine holds
    (a tied family's head copy included), within 1 %."""
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import load_hardware

    for mt, path in checkpoints.items():
        mem = single_runs[mt]["memory"][0]
        held = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        predicted = predict(load_config(None, _overrides(path, SINGLE)), load_hardware("h100"))["memory_bytes"]
        want = sum(v for k, v in predicted.items() if k not in ("activations", "total"))
        assert abs(held - want) <= 0.01 * held, (mt, held, want)


def test_a_mixture_of_experts_stays_whole_on_each_tp_rank_and_is_counted_so(checkpoints):
    """transformers' plan splits Qwen2-MoE's experts over tp (moe_tp_experts, packed_colwise); the
    engine keeps its whole MoE block (router, experts, shared expert and its gate) on every tp rank
    and splits attention only (test_dp_tp_pp_matches_transformers holds that run). The planner
    counts the block as held whole: read off the checkpoint's headers, as transformers' model has it."""
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.models import generic, get_arch

    spec = get_arch("qwen2_moe")
    assert spec.tp_plan and all(name.startswith("self_attn.") for name in spec.tp_plan), spec.tp_plan
    assert "mlp.experts" in str(generic._tp_plan_raw("qwen2_moe"))  # (transformers' plan has them)
    cfg = load_config(None, _overrides(checkpoints["qwen2_moe"], THREE_D))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2_moe"], local_files_only=True)
    blocks = hf.model.layers
    whole = sum(p.numel() for b in blocks for p in b.mlp.parameters()) // len(blocks)
    experts = sum(p.numel() for b in blocks for p in b.mlp.experts.parameters()) // len(blocks)
    assert 0 < experts < whole and spec.expert_params(cfg.model) == experts  # (ep shards these)
    assert spec.whole_params(cfg.model) == whole - experts  # the router and the shared expert
