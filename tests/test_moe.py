"""Mixtures of experts (qwen3-moe, mixtral): every layout trains the model transformers' own
Qwen3MoeForCausalLM / MixtralForCausalLM trains in one process (tests/reference_moe.py): the
loss with the routers' auxiliary loss, every parameter's gradient norm, the final weights, fp32.
Each launch runs several layouts in the same gloo processes (tests/gloo_harness.run_gloo_jobs)."""

from __future__ import annotations

import numpy as np
import pytest
from gloo_harness import run_gloo_jobs
from reference_moe import moe_reference_run
from test_oracle import assert_oracle, layout

from raytrain_hybrid import cli
from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

TINY = (
    "train.steps=2",
    "train.global_batch_size=8",
    "data.path=memory",
    "model.num_layers=2",
    "model.seq_len=16",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=32",  # heads wider than hidden_size / num_heads, as Qwen3-MoE's are
    "model.ffn_hidden_size=32",
    "model.num_experts=4",
    "model.experts_per_token=2",
    # Large enough that a wrong auxiliary gradient shows in every router's gradient norm.
    "model.router_aux_loss_coef=0.1",
)


def _check(arch: str, results: dict, names: list[str]) -> list[dict]:
    common = [f"model.arch={arch}", *TINY]
    # The reference starts from the first layout's initial state; every other layout's must equal it.
    reference = moe_reference_run(load_config(None, common), initial=results[names[0]]["probe"]["initial"])
    for name in names:
        assert_oracle(results[name], reference)
        for got, want in zip(results[name]["history"], reference, strict=True):
            # the weighted auxiliary loss reported apart (the loss, compared above, includes it)
            assert got["router_aux_loss"] == pytest.approx(want["router_aux_loss"], rel=1e-4, abs=1e-7), name
            load = got["expert_load"]
            # Every token of the global batch routed to top-k experts in each MoE layer, none dropped.
            assert len(load) == 4 and sum(load) == 8 * 16 * 2 * 2, (name, load)
            assert got["dropped_tokens"] == 0
    return reference


AC = "parallelism.activation_checkpointing=true"
DENSE_LAYOUTS = {  # dp, tp (with and without sequence parallelism), pp, ZeRO-1 and FSDP, at ep = 1
    "qwen3-moe/1x2x2-sp": layout(1, 2, 2, "1F1B", 2),
    "qwen3-moe/2x2x1-zero1": layout(2, 2, 1, "1F1B", 2, 1),
    "mixtral/2x1x2-zero3": layout(2, 1, 2, "1F1B", 2, 3),
    "mixtral/1x2x2-nosp-gpipe": layout(1, 2, 2, "GPipe", 2, 0, "parallelism.sequence_parallel=false"),
    # Context parallelism: each cp rank routes its half of every sequence; the balance loss sums over both.
    "mixtral/1x2x1-cp2": layout(1, 2, 1, "1F1B", 2, 0, "parallelism.cp=2"),
}
EP_LAYOUTS = {  # parallelism.ep = 2 and 4 with tp (SP), pp (activation checkpointing), ZeRO-0, ZeRO-1, ZeRO-2/3
    "ep2-dp2-tp2": layout(2, 2, 1, "1F1B", 2, 0, "parallelism.ep=2"),
    "ep2-dp2-pp2-zero2-ac": layout(2, 1, 2, "1F1B", 2, 2, "parallelism.ep=2", AC),
    "ep4-dp4-zero3": layout(4, 1, 1, "1F1B", 2, 3, "parallelism.ep=4"),
    # Every block compiled (inductor): the dispatch and the routers' bookkeeping run between graphs.
    # On two ranks of their own (COMPILED): each rank compiles cold, so four would cost twice the CPU.
    "ep2-dp2-zero0-compile": layout(2, 1, 1, "1F1B", 2, 0, "parallelism.ep=2", "parallelism.compile=true"),
    "ep2-dp4-zero1": layout(4, 1, 1, "1F1B", 2, 1, "parallelism.ep=2"),
    # cp = 2: the cp ranks join the ranks holding the same experts (FSDP shards over dp/ep x cp).
    "ep2-dp2-cp2-zero3": layout(2, 1, 1, "1F1B", 2, 3, "parallelism.ep=2", "parallelism.cp=2"),
}


COMPILED = "ep2-dp2-zero0-compile"


def _ep_job(name: str) -> list[str]:
    return ["model.arch=qwen3-moe", *TINY, *EP_LAYOUTS[name]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every layout below in one launch of four gloo ranks (the compiled one on two); the first EP layout saves a
    checkpoint that a run at ep = 4 resumes from, the ZeRO-1 one a checkpoint that a run at
    dp = 2, tp = 2 (ZeRO-1, ep = 2) resumes from."""
    out = tmp_path_factory.mktemp("moe-runs")
    jobs: dict = {name: [f"model.arch={name.split('/')[0]}", *TINY, *lay] for name, lay in DENSE_LAYOUTS.items()}
    jobs |= {name: _ep_job(name) for name in EP_LAYOUTS if name != COMPILED}
    jobs["ep2-dp2-tp2"] += ["checkpoint.interval=1", f"run.output_dir={out / 'saved'}"]
    # ZeRO-1 under ep saves its sliced AdamW state whole and loads it back into other slices.
    jobs["ep2-dp4-zero1"] += ["checkpoint.interval=1", f"run.output_dir={out / 'saved-zero1'}"]
    jobs["resumed-at-ep2-tp2-zero1"] = {
        "overrides": [
            *_ep_job("ep2-dp2-tp2"),
            "parallelism.zero=1",
            f"run.output_dir={out / 'resumed-zero1'}",
        ],
        "resume": str(out / "saved-zero1" / "checkpoints" / "step_1"),
    }
    jobs["resumed-at-ep4"] = {
        "overrides": [*_ep_job("ep4-dp4-zero3"), f"run.output_dir={out / 'resumed'}"],
        "resume": str(out / "saved" / "checkpoints" / "step_1"),
    }
    # An elastic run (dp=8, min_dp=4, ep=2) restarted on 4 ranks: dp=4 with twice the
    # micro-batches, ep=2 kept, the experts read back from the step-1 checkpoint saved at dp=2, tp=2.
    jobs["elastic-dp8-at-dp4"] = {
        "overrides": [
            *("model.arch=qwen3-moe", *TINY, *layout(8, 1, 1, "1F1B", 1, 0, "parallelism.ep=2")),
            *("parallelism.min_dp=4", f"run.output_dir={out / 'elastic'}"),
        ],
        "resume": str(out / "saved" / "checkpoints" / "step_1"),
    }
    # Compiled blocks: one cold inductor cache for the launch, compiled in each rank's own process.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(out / "inductor"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    return run_gloo_jobs(4, jobs) | run_gloo_jobs(2, {COMPILED: _ep_job(COMPILED)}, env=env)


def test_moe_layouts_match_transformers(runs):
    """dp, tp (with and without sequence parallelism), pp, cp, ZeRO-1 and FSDP, for both architectures."""
    _check("mixtral", runs, [name for name in DENSE_LAYOUTS if name.startswith("mixtral/")])
    _check("qwen3-moe", runs, [name for name in DENSE_LAYOUTS if name.startswith("qwen3-moe/")])


def test_expert_parallel_layouts_match_transformers(runs):
    """parallelism.ep = 2 and 4: experts sharded over data-parallel ranks, tokens sent to them by
    all-to-all; with tp (sequence parallel) and pp (activation checkpointing: the recomputation
    exchanges the tokens again), under ZeRO-0 replication, ZeRO-1 (the experts' AdamW state sliced
    over the ranks holding the same experts) and FSDP, with cp = 2, every block compiled (ZeRO-0); and a run
    saved at ep = 2 resumed at ep = 4 (the checkpoint resharded across ep sizes), one saved under
    ZeRO-1 resumed at another dp and tp, and an elastic run restarted at a smaller dp (ep kept),
    continue the same training."""
    results, jobs = runs, {name: _ep_job(name) for name in EP_LAYOUTS}
    reference = _check("qwen3-moe", results, list(EP_LAYOUTS))
    assert_oracle(results["resumed-at-ep4"], reference, first=1)
    assert_oracle(results["resumed-at-ep2-tp2-zero1"], reference, first=1)
    assert_oracle(results["elastic-dp8-at-dp4"], reference, first=1)
    assert [h["dp"] for h in results["elastic-dp8-at-dp4"]["history"]] == [4]
    # Compiled: the first step compiles, the second none (its routing's new shapes stay outside the graphs).
    compiled = results[COMPILED]["history"]
    assert compiled[0]["compiles"] > 0 and [h["compiles"] for h in compiled[1:]] == [0], compiled
    # Under replication (ZeRO-0) each rank holds every weight but the experts, and 1/ep of those.
    full = results[COMPILED]["probe"]["initial"]
    experts = sum(v.size for n, v in full.items() if ".experts." in n)
    others = sum(v.size for n, v in full.items() if ".experts." not in n)
    assert {m["param_bytes"] for m in results[COMPILED]["memory"]} == {4 * (others + experts // 2)}
    # ZeRO-1: each rank keeps AdamW's two moments of 1/4 of the other weights and of 1/2 of its
    # 1/ep of the experts (plus one step counter per part).
    sliced = -(-others // 4) + -(-experts // 2 // 2)
    assert {m["optimizer_bytes"] for m in results["ep2-dp4-zero1"]["memory"]} == {2 * 4 * sliced + 2 * 4}
    # The planner's parameter, gradient and AdamW bytes per rank are what the ranks held (within 5 %).
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import load_hardware

    for name in (COMPILED, "ep4-dp4-zero3", "ep2-dp2-tp2", "ep2-dp4-zero1"):
        want = predict(load_config(None, jobs[name]), load_hardware("h100"))["memory_bytes"]
        for key, measured in (("params", "param_bytes"), ("grads", "grad_bytes"), ("optimizer", "optimizer_bytes")):
            got = max(m[measured] for m in results[name]["memory"])
            assert abs(got - want[key]) <= 0.05 * got, (name, key, got, want[key])


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["model.arch=llama", "parallelism.ep=2"], "parallelism.ep", "mixture-of-experts"),
        (
            ["parallelism.ep=3", "parallelism.dp=6", "parallelism.microbatches=1"],
            "parallelism.ep",
            "model.num_experts=8",
        ),
        (["parallelism.ep=4", "parallelism.dp=2"], "parallelism.ep", "parallelism.dp=2"),
    ],
)
def test_bad_ep_is_refused_before_workers_start(overrides, key, says, capsys):
    args = ["check", "--topology", "64", "--set", "model.arch=qwen3-moe", "--set", "parallelism.pp=1"]
    args += ["--set", "train.global_batch_size=48"]
    for o in overrides:
        args += ["--set", o]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert key in err and says in err, err


def test_check_shows_ep_for_the_cpu_example(capsys):
    assert cli.main(["check", "examples/moe_cpu.toml", "--topology", "8"]) == 0
    out = capsys.readouterr().out
    assert "layout ok: dp=4 ep=4 tp=1 pp=2 on 1 node(s) [8]" in out
    assert "ep groups: [[0, 1, 2, 3], [4, 5, 6, 7]]" in out  # each pipeline stage's 4 replicas share the experts
    assert cli.main(["check", "examples/moe_cpu.toml", "--topology", "8", "--set", "parallelism.ep=2"]) == 0
    assert "ep groups: [[0, 1], [2, 3], [4, 5], [6, 7]]" in capsys.readouterr().out


def test_start_line_and_summary_name_ep():
    """The start line and summary.json's layout name ep, as check's layout line does."""
    from types import SimpleNamespace

    from raytrain_hybrid.launch.records.summary import summarize
    from raytrain_hybrid.launch.runtime.start import RunPlan

    cfg = load_config("examples/moe_cpu.toml")
    plan = RunPlan(
        cfg=cfg,
        point=SimpleNamespace(path=None, step=0),
        reach=None,
        use_gpu=False,
        resources={"CPU": 1},
        counts=[8],
        placement=[8],
        layout_hw=None,
        end=20,
    )
    assert plan.lines()[0].startswith("start: dp=4 ep=4 tp=1 pp=2, 8 workers"), plan.lines()
    assert summarize(cfg, [], [])["layout"]["ep"] == 4


def test_expert_weights_follow_the_init_rule(runs):
    """The experts' stacked 3D weights and the router are drawn like any weight matrix (not the ones of a
    norm): the engine's initial state (a layout's gathered step-0 weights, which every other layout's and
    the reference's equal) holds, for each, the value the init rule draws for its name, N(0, init_std)."""
    import torch

    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage, init_value, param_kinds

    cfg = load_config(None, ["model.arch=qwen3-moe", *TINY])
    spec = get_arch("qwen3-moe")
    stage = build_stage(spec, spec.hf_config(cfg), [0], first=True, last=True)
    kinds = param_kinds(stage)
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):
        assert kinds[f"model.layers.0.{name}"] == "normal"
    assert kinds["model.layers.0.self_attn.q_norm.weight"] == "ones"
    shapes = {n: p.shape for n, p in stage.named_parameters()}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == torch.Size([4, 64, 64])
    initial = runs["qwen3-moe/1x2x2-sp"]["probe"]["initial"]
    seed, std = cfg.train.seed, cfg.train.init_std
    for layer in range(2):
        for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):
            full = f"model.layers.{layer}.{name}"
            got = initial[full]
            assert np.array_equal(got, init_value(full, torch.Size(got.shape), "normal", seed, std).numpy()), full
            assert abs(float(got.std()) - std) < 0.1 * std, (full, float(got.std()))
        norm = initial[f"model.layers.{layer}.self_attn.q_norm.weight"]
        assert np.array_equal(norm, np.ones_like(norm))
    # Each expert its own draw (one generator over the stacked tensor, not one expert's values repeated).
    experts = initial["model.layers.0.mlp.experts.gate_up_proj"]
    assert not np.array_equal(experts[0], experts[1])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.arch=mixtral", "model.num_experts=4", "model.experts_per_token=5"], "model.experts_per_token"),
        (["model.arch=qwen3-moe", "model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef"),
        (["model.arch=llama", "model.num_experts=16"], "model.num_experts"),  # a dense model has no experts
        (["model.arch=llama", "model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef"),
    ],
)
def test_moe_keys_refused(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_moe_parameter_counts(arch):
    """The planner's counts against the model transformers builds: a block holds every expert
    (param_parts, what pipeline splits and memory weigh); a token meets its top-k only (FLOPs)."""
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    cfg = load_config(None, [f"model.arch={arch}", *TINY])
    spec, m = get_arch(arch), cfg.model
    stage = build_stage(spec, spec.hf_config(cfg), [0], first=True, last=True)
    block = dict(stage.model.layers["0"].named_parameters())
    assert spec.param_parts(m)[0] == sum(p.numel() for p in block.values())
    experts = sum(p.numel() for n, p in block.items() if ".experts." in n)
    matmuls = sum(p.numel() for n, p in block.items() if n.endswith("proj.weight") or n == "mlp.gate.weight")
    per_token = matmuls + experts * m.experts_per_token // m.num_experts
    assert spec.matmul_params(m) == m.num_layers * per_token + m.vocab_size * m.hidden_size


QWEN3_30B_A3B = [  # Qwen/Qwen3-30B-A3B's sizes (its config.json), 4k sequences
    *("model.arch=qwen3-moe", "model.hidden_size=2048", "model.num_layers=48", "model.num_heads=32"),
    *("model.num_kv_heads=4", "model.ffn_hidden_size=768", "model.num_experts=128", "model.experts_per_token=8"),
    *("model.vocab_size=151936", "model.seq_len=4096", "train.global_batch_size=64", "train.dtype=bfloat16"),
    "model.head_dim=128",
]


def test_planner_shards_experts_where_replicas_do_not_fit():
    """Qwen3-30B-A3B on 8 H100 without full sharding: one copy of every expert's weights,
    gradients and AdamW state is ~450 GiB, so only layouts with ep do fit; the FLOPs count the
    8 active experts of a token, not the 128."""
    import dataclasses

    from raytrain_hybrid.models.flops import matmul_params
    from raytrain_hybrid.planner.hardware import load_hardware
    from raytrain_hybrid.planner.search import plan

    cfg = load_config(None, QWEN3_30B_A3B)
    hw = dataclasses.replace(load_hardware("h100"), gpus_per_node=8)
    rows = plan(cfg, 8, hw, fixed={"zero": 2, "tp": 1, "pp": 1})
    fits = [r for r in rows if r["feasible"]]
    assert fits and all(r["ep"] > 1 for r in fits)
    assert any(r["ep"] == 1 for r in rows) and not any(r["ep"] == 1 and r["feasible"] for r in rows)
    assert fits[0]["time_s"]["ep"] > 0  # the all-to-alls are priced
    assert 2.5e9 < matmul_params(cfg.model) < 4e9  # "A3B": about 3B active parameters


def test_trackers_get_expert_load_per_expert():
    from raytrain_hybrid.launch.records.tracking import numbers

    got = numbers({"step": 3, "loss": 2.5, "expert_load": [10, 30], "dropped_tokens": 0, "note": "x"})
    assert got == {"loss": 2.5, "expert_load/0": 10.0, "expert_load/1": 30.0, "dropped_tokens": 0.0}


def test_pretrained_moe_loads_into_expert_shards_and_exports_back(tmp_path):
    """A Qwen3-MoE checkpoint as transformers writes it (each expert's gate/up/down apart) loads
    into ep x tp shards (every parameter equal to the checkpoint's), and `export` writes the
    trained model back in that layout: transformers loads it with the engine's weights and logits."""
    import torch
    import transformers as tf
    from gloo_harness import run_gloo
    from test_pretrained import _tokenizer

    src, out, exported = tmp_path / "qwen3-moe", tmp_path / "run", tmp_path / "hf"
    config = tf.Qwen3MoeConfig(
        **dict(vocab_size=4096, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, head_dim=16),
        **dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        **dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
    )
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(config).save_pretrained(src)
    _tokenizer().save_pretrained(src)
    start = tf.AutoModelForCausalLM.from_pretrained(src).state_dict()
    result = run_gloo(
        [f"model.pretrained={src}", "data.path=memory", "model.seq_len=16", "train.steps=1", "train.lr=1e-3",
         "train.global_batch_size=4", "parallelism.dp=2", "parallelism.ep=2", "parallelism.tp=2", "parallelism.pp=1",
         "parallelism.microbatches=1", "checkpoint.interval=1", f"run.output_dir={out}"]
    )  # fmt: skip
    initial = result["probe"]["initial"]
    assert sorted(initial) == sorted(start)
    for name, value in initial.items():
        assert np.array_equal(value, start[name].numpy()), name
    assert cli.main(["export", str(out), str(exported)]) == 0
    back = tf.AutoModelForCausalLM.from_pretrained(exported).eval()
    final = {n: torch.as_tensor(v) for n, v in result["probe"]["final"].items()}
    for name, value in back.state_dict().items():
        assert torch.equal(value, final[name]), name
    trained = tf.Qwen3MoeForCausalLM(config).eval()
    trained.load_state_dict(final)
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(back(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-5)


def test_planner_counts_qwen3_30b_a3b_as_transformers_builds_it():
    """Its config.json (heads of 128, not hidden_size / num_heads = 64): the planner's parameter
    count is the transformers model's, built on the meta device; the active parameters are the
    attention, the routers, 8 of 128 experts a layer and the head (about 3.3 B with the embedding)."""
    import torch
    import transformers as tf

    from raytrain_hybrid.models.flops import attention_width, matmul_params
    from raytrain_hybrid.models.params import param_count

    where = "tests/assets/Qwen3-30B-A3B"
    m = load_config(None, [f"model.pretrained={where}"]).model
    assert (m.head_dim, attention_width(m)) == (128, 4096)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(where))
    named = {n: p.numel() for n, p in model.named_parameters()}
    assert param_count(m) == sum(named.values())
    experts = sum(v for n, v in named.items() if ".experts." in n)
    dense = sum(v for n, v in named.items() if n.endswith(("proj.weight", "mlp.gate.weight", "lm_head.weight")))
    assert matmul_params(m) == dense + experts * 8 // 128
    assert 3.3e9 < matmul_params(m) + named["model.embed_tokens.weight"] < 3.4e9


def test_elastic_dp_values_keep_ep_dividing_dp():
    """parallelism.min_dp with ep: a start's dp is one that splits the step's micro-batches and
    that ep divides; none such below dp is refused naming min_dp and the ep values that would shrink."""
    from raytrain_hybrid.config.elastic import at_world, usable_dps

    moe = ["model.arch=qwen3-moe", "train.global_batch_size=48", "parallelism.pp=1", "parallelism.tp=1"]
    moe += ["parallelism.microbatches=3"]
    elastic = [*moe, "parallelism.dp=8", "parallelism.min_dp=3"]
    assert usable_dps(load_config(None, elastic).parallelism) == [3, 4, 6, 8]
    ep2 = load_config(None, [*elastic, "parallelism.ep=2"])
    assert usable_dps(ep2.parallelism) == [4, 6, 8]
    start = at_world(ep2, 6).parallelism  # a restart on 6 workers
    assert (start.dp, start.ep, start.microbatches) == (6, 2, 4)
    with pytest.raises(ConfigError) as err:
        load_config(None, [*moe, "parallelism.dp=4", "parallelism.min_dp=2", "parallelism.ep=4"])
    assert err.value.key == "parallelism.min_dp" and "parallelism.ep in {1, 2}" in err.value.fix, err.value.fix
