"""The generic decoder path's family-by-family mechanisms, without a process group: where a family's
tensors lie in its files, which layers take rotary tables and materialised masks, how many blocks it
has, its dropout, and the planner's count of tiny models of the matrix's more unusual families
(latent attention, mixtures of experts with dense first layers, blocks holding two attention
sublayers). scripts/model_matrix.py holds each family to the training oracle."""

from __future__ import annotations

import dataclasses
import re
from unittest import mock

import pytest
import torch
from test_models import SINGLE, tiny_sizes
from transformers import AutoConfig

from raytrain_hybrid.config import load_config
from raytrain_hybrid.models import generic, generic_forward, generic_split, generic_weights


@pytest.fixture(autouse=True)
def _specs_read_afresh():
    """Many tests here stand in a verdict for generic.verified; a spec cached meanwhile (get_arch
    reads the verdict when first asked for) must not outlive the test, whatever runs next."""
    yield
    from raytrain_hybrid.models import get_arch

    get_arch.cache_clear()


def test_file_names_run_the_family_mapping_backwards():
    """Chained, anchored renamings undone as transformers' own save does (EXAONE's GPT-2-style
    names), and a mapping kept under the causal LM's class name (GPT-NeoX's head)."""
    names = generic_weights.checkpoint_names
    exaone = names("exaone", "model.layers.0.self_attn.o_proj.weight")
    assert exaone[-1] == "transformer.h.0.attn.attention.out_proj.weight"
    assert names("exaone", "model.embed_tokens.weight")[-1] == "transformer.wte.weight"
    assert names("gpt_neox", "lm_head.weight") == ("lm_head.weight", "embed_out.weight")
    assert names("mixtral", "model.layers.1.mlp.gate.weight")[-1] == "model.layers.1.block_sparse_moe.gate.weight"
    assert names("qwen3", "model.norm.weight") == ("model.norm.weight",)


def test_only_a_tied_head_may_be_read_from_the_embedding():
    untied, _, _ = generic_weights.from_hf("gpt_neox", "lm_head.weight", {"tie_word_embeddings": False})
    assert "gpt_neox.embed_in.weight" not in untied
    tied, _, _ = generic_weights.from_hf("qwen3", "lm_head.weight", {"tie_word_embeddings": True})
    assert tied[-1] == "model.embed_tokens.weight"


def test_masks_and_rotary_tables_follow_the_layer_types():
    """DeepSeek's sparse "indexed_attention" reads a causal mask tensor even under SDPA; full and
    linear attention get none (causal by the kernel, no padding); Beam's full-attention layers
    take no rotary tables (their ``rope_parameters`` entry is None)."""
    config = AutoConfig.for_model("deepseek_v32")
    config._attn_implementation = "sdpa"
    positions = torch.arange(6)[None]
    mask = generic_forward._mask("indexed_attention", config, positions, False, torch.float32)
    assert torch.equal(mask[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    for kind in ("full_attention", "linear_attention"):
        assert generic_forward._mask(kind, config, positions, False, torch.float32) is None
    beam = AutoConfig.for_model("beam")
    assert generic_forward._nope(beam, "full_attention") and not generic_forward._nope(beam, "sliding_attention")
    # A sliding window the row fits in masks nothing: no mask tensor (SDPA's causal kernel, as for full
    # attention: Mistral's 4096 over shorter rows); a shorter window is masked.
    mistral = AutoConfig.for_model("mistral", sliding_window=6)
    mistral._attn_implementation = "sdpa"
    assert generic_forward._mask("sliding_attention", mistral, positions, False, torch.float32) is None
    mistral.sliding_window = 4
    window = generic_forward._mask("sliding_attention", mistral, positions, False, torch.float32)[0, 0]
    assert window[5].tolist() == [False, False, True, True, True, True]


def test_blocks_holding_two_attention_sublayers_are_counted_once():
    config = AutoConfig.for_model("longcat_flash", num_layers=3)
    assert (config.num_hidden_layers, generic.blocks(config)) == (6, 3)
    assert generic.blocks(AutoConfig.for_model("qwen3", num_hidden_layers=5)) == 5


def test_dropout_is_off_for_engine_and_reference():
    config = AutoConfig.for_model("seed_oss")
    assert config.residual_dropout > 0 and config.attention_dropout > 0
    generic.dropout_off(config)
    assert (config.residual_dropout, config.attention_dropout) == (0.0, 0.0)


@pytest.mark.parametrize(
    "model_type", ["deepseek_v3", "glm4_moe_lite", "dots1", "longcat_flash", "gpt_neox", "qwen3_next"]
)
def test_the_planner_counts_a_tiny_family_as_transformers_does(model_type, tmp_path, monkeypatch):
    """models.params from config.json alone, within 5 % of transformers' count of the model it
    builds (on the meta device): latent attention, experts after dense layers, shared experts."""
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.models.params import param_count

    monkeypatch.setenv("RAYTRAIN_MODEL_MATRIX", "1")  # the planner's count, whatever the recorded verdict
    generic.verified.cache_clear()
    config = AutoConfig.for_model(model_type, **{**tiny_sizes(model_type), "num_key_value_heads": 4})
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        want = AutoModelForCausalLM.from_config(config).num_parameters()
    cfg = load_config(None, [f"model.pretrained={tmp_path}", "data.path=memory", "model.seq_len=32", *SINGLE])
    assert param_count(cfg.model) == pytest.approx(want, rel=0.05)
    generic.verified.cache_clear()


@pytest.mark.parametrize("model_type", ["minimax", "glm4_moe", "apertus"])
def test_buffers_a_checkpoints_files_hold_are_not_counted_as_parameters(model_type, tmp_path):
    """A family whose model keeps buffers in its state dict (MiniMax's decay tables, a router's
    score-correction bias, an activation's constants) has them in its files too: the planner's count
    off the files' headers leaves them out, as transformers' does, and is exact. The negative
    control: counted with them, the files hold more than the model's parameters."""
    from test_models import make_checkpoint
    from transformers import AutoModelForCausalLM

    from raytrain_hybrid.models import generic_counts, generic_facts
    from raytrain_hybrid.models.hf_checkpoint import tensor_sizes
    from raytrain_hybrid.models.params import param_count

    path = make_checkpoint(tmp_path, model_type)
    stored = sum(tensor_sizes(str(path)).values())  # (every tensor the files hold)
    want = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).num_parameters()
    assert generic_facts.buffers(model_type) and stored > want  # (the files do hold buffers)
    m = {"pretrained": str(path), "pretrained_revision": ""}
    assert generic_counts.from_headers(model_type, m) == generic_counts.built_counts(model_type, m)
    cfg = load_config(None, [f"model.pretrained={path}", "data.path=memory", "model.seq_len=32", *SINGLE])
    assert param_count(cfg.model) == want


@pytest.mark.parametrize("model_type", ["minimax", "youtu"])
def test_modules_the_tp_plan_leaves_out_are_counted_whole_on_each_tp_rank(model_type, tmp_path):
    """MiniMax's linear attention and Youtu's latent attention are in no style of transformers' plan:
    each tp rank holds and computes them whole. The planner's parameter bytes of a dp=1 x tp=2 rank
    are what the engine's rank holds (0.5 %; the tiny model's embedding and head are most of it);
    counted as split, as the planner did, they would miss by more than 1 %."""
    from gloo_harness import run_gloo_jobs
    from test_models import COMMON, make_checkpoint

    from raytrain_hybrid.models import generic_facts, get_arch
    from raytrain_hybrid.models.params import num_blocks
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import load_hardware

    assert generic_facts.tp_whole(model_type)  # (recorded: modules the plan leaves out)
    path = make_checkpoint(tmp_path, model_type)
    layout = ("parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1")
    overrides = [f"model.pretrained={path}", *COMMON, *layout, "parallelism.sequence_parallel=false"]
    held = run_gloo_jobs(2, {model_type: overrides})[model_type]["memory"][0]["param_bytes"]
    cfg = load_config(None, overrides)
    predicted = predict(cfg, load_hardware("h100"))["memory_bytes"]["params"]
    assert abs(predicted - held) <= 0.005 * held, (held, predicted)
    whole = 4 * get_arch(cfg.model.arch).tp_whole_params(cfg.model) * num_blocks(cfg.model)
    assert whole / 2 > 0.01 * held  # (what counting them split would leave out)


def _block_collectives(rank: int, world: int, overrides: list[str], scratch: str) -> dict:
    """{(block, "self_attn" | "mlp" | "", "forward" | "backward"): {collective: count}} of one forward
    and backward at tp=2: the engine's rank 0 built in a fake two-rank group (collectives counted,
    not run)."""
    import re

    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raytrain_hybrid.data.corpus import Batch
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
    from raytrain_hybrid.engine.trainer import Trainer

    dist.destroy_process_group()  # (the harness's world of one: the fake world of two instead)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cfg = load_config(None, overrides)
        dims = ParallelDims.from_config(cfg.parallelism)
        trainer = Trainer(cfg, dims, dims.build_mesh("cpu", arrange_ranks(dims, ["n"] * 2)), torch.device("cpu"))
        ids = torch.randint(3, 200, (cfg.train.global_batch_size, cfg.model.seq_len))
        with CommDebugMode() as comms:
            trainer._forward_backward(Batch((ids,), ids))
    finally:
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{scratch}/pg", rank=0, world_size=1)
    out = {}
    for name, by in comms.comm_module_counts.items():
        if found := re.search(r"layers\.(\d+)(?:\.(self_attn|mlp))?$", name):
            for way in ("forward", "backward"):
                ops = {str(op).split(".")[-1]: n for op, n in by.get(way, {}).items()}
                out[(int(found.group(1)), found.group(2) or "", way)] = ops
    return out


def _attention_all_reduces(overrides: list[str], scratch: str) -> dict[int, int]:
    """Per block, the forward TP all-reduces its attention runs at tp=2."""
    from gloo_harness import launch_ranks

    counts = launch_ranks(_block_collectives, 1, overrides, scratch)
    blocks = load_config(None, overrides).model.num_layers
    return {b: counts.get((b, "self_attn", "forward"), {}).get("all_reduce", 0) for b in range(blocks)}


@pytest.mark.parametrize(("model_type", "sp"), [("llama", True), ("llama", False), ("qwen3", True), ("qwen3", False)])
def test_a_blocks_tensor_parallel_collectives_are_as_the_docs_say(model_type, sp, tmp_path):
    """docs/parallelism.md: with sequence parallelism the hand-written Llama runs one all-gather and
    one reduce-scatter for attention and for the MLP, forward and backward (Megatron-LM's count); a
    generic family the same forward, and backward an all-gather, then an all-reduce for each
    column-parallel projection reading the hidden states (q, k, v; gate, up). Without it, one
    all-reduce each forward, and backward one for each such projection. (Qwen3's two more in
    attention are its q and k norms' weight gradients, which every tp rank holds.)"""
    from gloo_harness import launch_ranks
    from test_models import COMMON, make_checkpoint

    model = (
        ["model.arch=llama"] if model_type == "llama" else [f"model.pretrained={make_checkpoint(tmp_path, model_type)}"]
    )
    layout = ("parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1")
    overrides = [*model, *COMMON, *layout, f"parallelism.sequence_parallel={str(sp).lower()}"]
    counts = launch_ranks(_block_collectives, 1, overrides, str(tmp_path))
    pair = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}
    norms = 2 if model_type == "qwen3" else 0
    if sp and model_type == "llama":
        want = {("self_attn", "forward"): pair, ("self_attn", "backward"): pair, ("mlp", "forward"): pair}
        want[("mlp", "backward")] = pair
    elif sp:
        gathered = {"all_gather_into_tensor": 1}
        want = {("self_attn", "forward"): pair, ("self_attn", "backward"): {**gathered, "all_reduce": 3 + norms}}
        want |= {("mlp", "forward"): pair, ("mlp", "backward"): {**gathered, "all_reduce": 2}}
    else:
        want = {("self_attn", "forward"): {"all_reduce": 1}, ("self_attn", "backward"): {"all_reduce": 3 + norms}}
        want |= {("mlp", "forward"): {"all_reduce": 1}, ("mlp", "backward"): {"all_reduce": 2}}
    for block in range(load_config(None, overrides).model.num_layers):
        got = {(part, way): counts.get((block, part, way), {}) for part, way in want}
        assert got == want, (block, got)


@pytest.mark.parametrize(("model_type", "whole"), [("youtu", 1.0), ("minimax", 0.5), ("qwen3", 0.0)])
def test_the_planner_charges_attention_all_reduces_where_the_engine_runs_them(model_type, whole, tmp_path):
    """Youtu's latent attention and MiniMax's linear-attention layers (every other block of the tiny
    one) are in no style of transformers' plan: at tp=2 their attention runs whole, with no
    all-reduce, which the engine's collectives show block by block. The planner charges attention's
    all-reduces (and its column/row pair) in the share of blocks that run them: none for Youtu, half
    for MiniMax, all for Qwen3."""
    from test_models import COMMON, make_checkpoint

    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.params import has_sequence_parallel
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import PROFILES

    layout = ("parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=1", "parallelism.microbatches=1")
    path = make_checkpoint(tmp_path, model_type)
    overrides = [f"model.pretrained={path}", *COMMON, *layout, "parallelism.sequence_parallel=false"]
    per_block = _attention_all_reduces(overrides, str(tmp_path))
    assert sum(1 for n in per_block.values() if n == 0) / len(per_block) == whole, per_block
    assert set(per_block.values()) <= {0, 1}  # (one forward all-reduce where attention is split)
    cfg = load_config(None, overrides)
    spec = get_arch(cfg.model.arch)
    assert spec.tp_whole_attention(cfg.model) == whole
    # Against the same run with every attention split (what the planner charged before): the MLP's
    # or MoE's share stays, attention's goes with the whole share. Without sequence parallelism a
    # split module costs two all-reduces and a column/row pair, a whole one nothing; with it (the
    # pair's overhead set to 0 here) a whole one its input's all-gather and that one's reduce-scatter.
    dense_mlp = not spec.expert_params(cfg.model)
    split = dataclasses.replace(spec, tp_whole_attention=lambda m: 0.0)
    for sp in (False, True):
        sp_cfg = load_config(None, [*overrides[:-1], f"parallelism.sequence_parallel={str(sp).lower()}"])
        sp = sp and has_sequence_parallel(sp_cfg.model)
        hw = dataclasses.replace(PROFILES["h100"], tp_pair_overhead_s=0.0) if sp else PROFILES["h100"]
        tp_time = predict(sp_cfg, hw)["time_s"]["tp"]
        with mock.patch("raytrain_hybrid.planner.cost.get_arch", lambda arch: split):
            all_split = predict(sp_cfg, hw)["time_s"]["tp"]
        if sp:
            mlp = 2.0 if dense_mlp else 1.0
            want = ((1 - whole) * 2 + whole * 1 + mlp) / (2 + mlp)
        else:
            mlp = 2.0 if dense_mlp else 0.0
            want = ((1 - whole) * 2 + mlp) / (2 + mlp)
        assert tp_time == pytest.approx(all_split * want, rel=1e-6), sp


def test_what_tp_leaves_whole_is_read_off_the_output_projections_names():
    """tp_whole_attention and tp_whole_mlp from the recorded tp_whole weights of a random-weight
    model built on the meta device: an output projection by its module's name, nested
    (Inkling 2's o_proj.linear) or split in two (DeepSeek-V4's o_b_proj), a dense MLP's down_proj
    or w2; a state-space hybrid's whole conv1d alone leaves its attention split (Qwen3-Next)."""
    from raytrain_hybrid.models import generic_counts

    m = load_config(None, ["model.arch=qwen3", "data.path=memory", "model.seq_len=32"]).model
    shares = {
        mt: (generic_counts.tp_whole_attention(mt, m), generic_counts.tp_whole_mlp(mt, m))
        for mt in ("inkling2_text", "deepseek_v4", "hunyuan_v1_dense", "lfm2", "qwen3_next", "qwen3")
    }
    assert shares == {
        "inkling2_text": (1.0, 0.0),
        "deepseek_v4": (1.0, 0.0),
        "hunyuan_v1_dense": (1.0, 1.0),
        "lfm2": (1.0, 1.0),
        "qwen3_next": (0.0, 0.0),
        "qwen3": (0.0, 0.0),
    }


def test_every_family_the_matrix_holds_is_counted_by_the_planner_within_5_percent():
    """The model matrix's record (scripts/model_matrix.py --planner redoes it): for every family that
    passed, the planner's count of its tiny checkpoint over transformers' count of the model."""
    import json
    from pathlib import Path

    record = json.loads((Path(generic.__file__).parents[1] / "assets" / "generic_families.json").read_text())
    rows = {mt: row for mt, row in record["families"].items() if row["status"] == "passed"}
    off = {mt: row.get("planner_params_ratio") for mt, row in rows.items()}
    off = {mt: r for mt, r in off.items() if not (isinstance(r, float) and abs(r - 1) <= 0.05)}
    assert len(rows) >= 60 and not off, off


def test_every_family_the_matrix_holds_exports_as_transformers_loads_it_and_the_page_says_so():
    """The matrix's export pass (scripts/model_matrix.py --export) held every family it holds: the
    export loads in transformers as the source's class with the source's names, config and logits;
    docs/models.md is what the script writes from the record."""
    import json
    import sys
    from pathlib import Path

    root = Path(generic.__file__).parents[2]
    record = json.loads((root / "raytrain_hybrid/assets/generic_families.json").read_text())
    rows = {mt: row for mt, row in record["families"].items() if row["status"] == "passed"}
    assert len(rows) >= 60 and record["export_passes"]
    assert not [mt for mt, row in rows.items() if row.get("export") is not True]
    sys.path.insert(0, str(root / "scripts"))
    from model_matrix import render_doc

    assert render_doc(record) == (root / "docs/models.md").read_text(), "run scripts/model_matrix.py --doc"


def test_a_family_recorded_without_tensor_parallelism_is_refused_at_tp2(monkeypatch):
    """The matrix records a family whose dp=2 x tp=2 x pp=2 run differs but whose dp=2 x pp=2 run
    holds (Apertus: its activation's learnt scalars see a column shard): check then refuses tp > 1,
    naming parallelism.tp, and takes tp = 1."""
    from raytrain_hybrid.errors import ConfigError

    row = {"status": "passed", "tp": False, "tp_reason": "differs from the reference at tp=2: ..."}
    monkeypatch.setattr(generic, "verified", lambda: {"qwen3": row})
    assert generic.refusal("qwen3", tp=1) is None
    with pytest.raises(ConfigError, match=r"parallelism\.tp=2: qwen3 differs from the reference at tp=2"):
        load_config(None, ["model.arch=qwen3", "data.path=memory", "parallelism.tp=2", "parallelism.dp=1"])


def test_fused_and_stacked_tensors_are_read_as_the_model_holds_them():
    """Sarvam-MoE's files fuse q, k and v in one tensor transformers splits by each target's size:
    k_proj is the block after q_proj's rows. LongCat-Flash's stacked gate_up_proj also holds its
    zero-computation experts' rows: one piece per row of the model's tensor, not per routed expert."""
    sarvam = AutoConfig.for_model("sarvam_moe", **tiny_sizes("sarvam_moe")).to_dict()
    q_rows = sarvam["num_attention_heads"] * sarvam["head_dim"]
    k_rows = sarvam["num_key_value_heads"] * sarvam["head_dim"]
    names, _, offset = generic_weights.from_hf("sarvam_moe", "model.layers.0.self_attn.v_proj.weight", sarvam)
    assert names[-1] == "model.layers.0.attention.query_key_value.weight" and offset == (q_rows + k_rows, 0)
    longcat = AutoConfig.for_model("longcat_flash", **tiny_sizes("longcat_flash")).to_dict()
    pieces = generic_weights.from_hf("longcat_flash", "model.layers.0.mlp.experts.gate_up_proj", longcat)
    routed, zero = longcat["n_routed_experts"], longcat["zero_expert_num"]
    assert zero > 0 and len(pieces) == 2 * (routed + zero)
    assert len(generic_weights.from_hf("longcat_flash", "model.layers.0.mlp.experts.down_proj", longcat)) == routed


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["model.arch=gemma2", "parallelism.cp=2"], "parallelism.cp", "gemma2 runs only transformers' eager attention"),
        (["model.arch=qwen3_next", "parallelism.cp=2"], "parallelism.cp", "qwen3_next has linear_attention layers"),
        (["model.arch=deepseek_v2", "parallelism.cp=2"], "parallelism.cp", "deepseek_v2 has latent attention"),
        (["model.arch=llama4_text", "parallelism.ep=2"], "parallelism.ep", "llama4_text stores its experts otherwise"),
        (
            ["model.arch=deepseek_v3", "model.router_aux_loss_coef=0.01"],
            "model.router_aux_loss_coef",
            "deepseek_v3 adds no router auxiliary loss in transformers",
        ),
        (["model.arch=qwen3", "model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef", "qwen3 has no experts"),
        (["model.arch=qwen2_moe", "model.num_experts=4"], "model.num_experts", "num_experts=60"),
        (["model.arch=qwen3", "parallelism.ep=2"], "parallelism.ep", "qwen3's model has no experts"),
    ],
)
def test_check_names_the_family_and_key_it_cannot_parallelise_so(overrides, key, words):
    """Context parallelism where the family's attention is not plain SDPA-able multi-head attention,
    expert parallelism where the model matrix did not hold it and the router's loss on transformers' own
    mixtures of experts: refused before
    workers start, naming the key, the model_type and why (tp=1 and dp=2: the layout is otherwise valid)."""
    from raytrain_hybrid.errors import ConfigError

    layout = ["parallelism.tp=1", "parallelism.pp=1", "parallelism.dp=2", "data.path=memory", "model.seq_len=32"]
    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        load_config(None, [*layout, *overrides])
    assert err.value.key == key


def test_a_router_loss_is_taken_where_transformers_adds_one_and_weighed_as_it_weighs_it():
    """model.router_aux_loss_coef on a family whose causal LM adds load_balancing_loss_func (the model
    matrix held its router: tests/test_models.py runs it) is accepted; unset, the weight is the
    config's own where it sets output_router_logits (as transformers adds it), else none."""
    from types import SimpleNamespace

    from raytrain_hybrid.models import generic_router

    layout = ["parallelism.tp=1", "parallelism.pp=1", "data.path=memory", "model.seq_len=32"]
    cfg = load_config(None, [*layout, "model.arch=qwen2_moe", "model.router_aux_loss_coef=0.01"])
    assert cfg.model.router_aux_loss_coef == 0.01
    assert generic_router.router("qwen2_moe") == {"router": "mlp.gate", "logits": 0, "block": "mlp"}
    assert generic_router.router("deepseek_v3") is None and generic_router.router("qwen3") is None
    on = SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.02)
    assert generic_router.default_coef(on) == 0.02
    assert generic_router.default_coef(SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.02)) == 0
    assert generic_router.default_coef(SimpleNamespace()) == 0
    # gpt-oss's TP plan names no experts: its router's parent is the block (matrix: held at dp1 x pp2)
    held = {"router": "mlp.router", "logits": 0, "block": "mlp"}
    assert generic_router.search("gpt_oss") == (held, None) and generic_router.router("gpt_oss") == held


def test_a_router_loss_nobody_held_is_refused_not_left_out(tmp_path, monkeypatch):
    """A checkpoint whose config.json asks for the router loss (output_router_logits) of a family the
    model matrix recorded no verdict for (another transformers, a registered family) is refused
    naming model.pretrained, instead of training without the loss transformers would add;
    model.router_aux_loss_coef=0 trains it without. Where the matrix held the loss at tp=1 only,
    tp=2 is refused with it and taken without it."""
    import json

    from test_models import make_checkpoint

    from raytrain_hybrid.errors import ConfigError

    path = make_checkpoint(tmp_path, "qwen2_moe")
    conf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**conf, "output_router_logits": True, "router_aux_loss_coef": 0.02}))
    layout = ["parallelism.pp=1", "data.path=memory", "model.seq_len=32", f"model.pretrained={path}"]
    tp1 = ["parallelism.tp=1", *layout]
    assert load_config(None, tp1).model.pretrained == str(path)  # (recorded: the matrix held its router)
    rows = generic.verified()
    monkeypatch.setattr(generic, "verified", lambda: {k: v for k, v in rows.items() if k != "qwen2_moe"})
    with pytest.raises(ConfigError, match="sets output_router_logits") as err:
        load_config(None, tp1)
    assert err.value.key == "model.pretrained" and "model.router_aux_loss_coef=0" in str(err.value)
    load_config(None, [*tp1, "model.router_aux_loss_coef=0"])
    with pytest.raises(ConfigError, match="leave the key out") as err:  # (a weight set: the key is named)
        load_config(None, [*tp1, "model.router_aux_loss_coef=0.05"])
    assert err.value.key == "model.router_aux_loss_coef"
    # Recorded without its router (Doge's: none found), it is refused alike; recorded as a family to which
    # transformers adds no such loss, or as a dense family (no verdict), it trains as transformers does
    from raytrain_hybrid.models.generic_router import NO_LOSS

    unfound = {"status": "passed", "tp": True, "aux": False, "aux_reason": "records its router logits from no module"}
    for row, refused in ((unfound, True), ({**unfound, "aux_reason": f"{NO_LOSS} (...)"}, False), ({}, False)):
        monkeypatch.setattr(generic, "verified", lambda row=row: {**rows, "qwen2_moe": {"status": "passed", **row}})
        if refused:
            with pytest.raises(ConfigError, match="sets output_router_logits"):
                load_config(None, tp1)
        else:
            load_config(None, tp1)
    tp_only = {**rows["qwen2_moe"], "aux_tp_reason": "differs from the reference at tp=2: (test)"}
    monkeypatch.setattr(generic, "verified", lambda: {**rows, "qwen2_moe": tp_only})
    tp2 = ["parallelism.tp=2", "parallelism.dp=1", *layout]
    with pytest.raises(ConfigError, match=re.escape("qwen2_moe with its router loss differs")) as err:
        load_config(None, tp2)
    assert err.value.key == "parallelism.tp"
    load_config(None, [*tp2, "model.router_aux_loss_coef=0"])


def test_experts_skipped_by_every_token_still_get_a_gradient():
    """LongCat-Flash's zero-computation experts: a batch routed to them alone leaves the real
    experts' weights out of the graph, and data parallelism's reduction then sees different
    gradients on different ranks (a dp=2 run failed so). The generic build keeps them in the graph
    with zero gradients; transformers' own module, without it, gives none (the negative control)."""
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model("longcat_flash", **tiny_sizes("longcat_flash"))
    routed = config.n_routed_experts
    ours = AutoModelForCausalLM.from_config(config)
    generic_forward.experts_always_used(ours, config)
    theirs = AutoModelForCausalLM.from_config(config)
    hidden = torch.randn(5, config.hidden_size)
    index = torch.full((5, config.moe_topk), routed)  # every token to the first zero-computation expert
    weights = torch.ones(5, config.moe_topk)
    for model, want in ((ours, True), (theirs, False)):
        experts = model.model.layers[0].mlp.experts
        out = experts(hidden.clone().requires_grad_(), index, weights)
        out.sum().backward()
        assert (experts.gate_up_proj.grad is not None) is want
    assert torch.count_nonzero(ours.model.layers[0].mlp.experts.down_proj.grad) == 0


def _block(model_type: str):
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **tiny_sizes(model_type))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).model.layers[0]


def test_the_sequence_parallel_plan_is_read_off_each_block():
    """Norms split by sequence; a child whose output a row-wise projection of the family's TP plan
    reduces gathers its input; one outside the plan (gpt-oss's attention and experts) runs whole
    and keeps this rank's shard; a block holding weights of its own is refused, naming the key."""
    from raytrain_hybrid.models import generic_sp

    qwen3 = generic.spec("qwen3")
    assert qwen3.sequence_parallel and qwen3.sp_plan_outer == {"model.norm": "seqnorm"}
    assert qwen3.sp_block(_block("qwen3")) == {
        "self_attn": "gather_hidden",
        "mlp": "gather_hidden",
        "input_layernorm": "seqnorm",
        "post_attention_layernorm": "seqnorm",
    }
    plan = generic_sp.block_plan(frozenset(), _block("gpt_oss"))  # (its plan reduces no child's output)
    assert (plan["self_attn"], plan["mlp"], plan["input_layernorm"]) == ("whole", "whole", "seqnorm")
    block = _block("qwen3")
    block.register_parameter("scale", torch.nn.Parameter(torch.ones(4, device="meta")))
    with pytest.raises(ValueError, match=r"\(scale\).*parallelism\.sequence_parallel=false"):
        generic_sp.block_plan(frozenset(), block)


def test_check_says_whether_sequence_parallelism_applies(monkeypatch):
    """At tp > 1 the plan's line says on, off by the key, or not applied and why (a family the model
    matrix recorded without it); the planner's activation memory counts the same: a family without
    sequence parallelism is predicted as tp alone, one with it holds less."""
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.params import sequence_parallel_line
    from raytrain_hybrid.planner.cost import activation_bytes

    layout = ["data.path=memory", "model.seq_len=32", "parallelism.dp=1", "parallelism.pp=1"]
    cfg = load_config(None, ["model.arch=qwen3", *layout, "parallelism.tp=2"])
    assert sequence_parallel_line(cfg) == "sequence parallelism: on (norms and the residual stream split over tp=2)"
    with_sp = activation_bytes(cfg, 1)
    off = load_config(None, ["model.arch=qwen3", *layout, "parallelism.tp=2", "parallelism.sequence_parallel=false"])
    assert sequence_parallel_line(off) == "sequence parallelism: off (parallelism.sequence_parallel=false)"
    assert sequence_parallel_line(load_config(None, ["model.arch=qwen3", *layout, "parallelism.tp=1"])) is None
    row = {"status": "passed", "tp": True, "sp": False, "sp_reason": "differs from the reference with sp"}
    monkeypatch.setattr(generic, "verified", lambda: {"qwen3": row})
    get_arch.cache_clear()
    try:
        cfg = load_config(None, ["model.arch=qwen3", *layout, "parallelism.tp=2"])
        assert sequence_parallel_line(cfg) == (
            "sequence parallelism: not applied: qwen3 differs from the reference with sp; tp runs without it"
        )
        assert activation_bytes(cfg, 1) == activation_bytes(off, 1) > with_sp
    finally:
        get_arch.cache_clear()


@pytest.mark.parametrize(
    ("model_type", "overrides", "key", "words"),
    [
        ("qwen3_next", ["data.packing=true"], "data.packing", "qwen3_next has linear_attention layers"),
        ("qwen3", ["data.packing=true"], "data.packing", "qwen3 differs from the reference with packing"),
        ("qwen3", ["lora.rank=4"], "lora.rank", "qwen3 differs from the reference with lora"),
        ("qwen2_moe", ["lora.rank=4"], "lora.rank", "qwen2_moe is a mixture of experts (num_experts=8)"),
        ("gemma2", ["lora.rank=4", "parallelism.tp=2"], "lora.rank", "gemma2 with lora.rank=4 differs at tp=2"),
    ],
)
def test_check_refuses_packing_and_lora_where_the_family_cannot_take_them(
    model_type, overrides, key, words, monkeypatch, tmp_path
):
    """A family whose layers do not attend by a mask cannot keep packed examples apart; one the model
    matrix recorded as differing from its reference with packing or LoRA is refused with that reason,
    naming the key and what works."""
    from raytrain_hybrid.errors import ConfigError

    row = {"status": "passed", "tp": True, "packing": False, "lora": False}
    row |= {
        "packing_reason": "differs from the reference with packing",
        "lora_reason": "differs from the reference with lora",
    }
    tp1_only = {"status": "passed", "tp": True, "lora": True, "lora_tp_reason": "differs at tp=2"}
    monkeypatch.setattr(generic, "verified", lambda: {"qwen3": row, "gemma2": tp1_only})
    AutoConfig.for_model(model_type, **tiny_sizes(model_type)).save_pretrained(tmp_path)
    layout = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "data.path=memory", "model.seq_len=32"]
    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        load_config(None, [f"model.pretrained={tmp_path}", *layout, *overrides])
    assert err.value.key == key and f"{key}=" in str(err.value)
    assert "data.packing=false" in str(err.value) or "lora.rank=0" in str(err.value)
    if "parallelism.tp=2" in overrides:  # held at tp=1 only: taken there
        assert "use parallelism.tp=1" in str(err.value)
        load_config(None, [f"model.pretrained={tmp_path}", *layout, *(o for o in overrides if "tp=" not in o)])


def test_per_layer_inputs_are_made_on_the_first_stage_and_carried(monkeypatch):
    """Gemma 4's per-layer embeddings (made from the token ids) live on the first stage only; a later
    stage takes them beside the hidden states (floats), told apart from packed positions (integers),
    and hands both on. A family the model matrix recorded as running eager (SDPA's rounding past the
    oracle's bound) runs eager and is refused context parallelism."""
    from raytrain_hybrid.errors import ConfigError
    from raytrain_hybrid.models.common import build_stage

    spec = generic.spec("gemma4_text")
    made = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
    assert spec.first_stage == ("model.embed_tokens", *(f"model.{n}" for n in made))
    assert generic.spec("qwen3").first_stage == ("model.embed_tokens",)
    config = AutoConfig.for_model("gemma4_text", **tiny_sizes("gemma4_text"))
    config._attn_implementation = "eager"
    with torch.device("cpu"):
        first, later = (build_stage(spec, config, [i], first=i == 0, last=False) for i in (0, 1))
    for stage in (first, later):  # the engine's materialisation: parameters drawn, computed buffers kept
        buffers = [
            (m, n, b.clone()) for m in stage.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta
        ]
        stage.to_empty(device="cpu")
        for m, n, b in buffers:
            m._buffers[n] = b
        for p in stage.parameters():
            torch.nn.init.normal_(p, std=0.02)
    assert later.model.embed_tokens_per_layer is None and first.model.embed_tokens_per_layer is not None
    ids = torch.randint(3, 100, (2, 8))
    positions = torch.arange(8).repeat(2, 1)
    h, pos, per_layer = first(ids, positions)
    assert torch.equal(pos, positions) and per_layer.shape == (2, 8, 4, 16)
    out = later(h, pos, per_layer)
    assert torch.equal(out[1], positions) and out[2] is per_layer
    assert not torch.equal(later(h, pos, torch.zeros_like(per_layer))[0], out[0])  # block 1 reads its slice

    monkeypatch.setattr(generic, "verified", lambda: {"qwen3": {"status": "passed", "attention": "eager"}})
    assert generic.attention_implementation("qwen3") == "eager"
    with pytest.raises(ConfigError, match="eager attention"):
        load_config(None, ["model.arch=qwen3", "data.path=memory", "model.seq_len=32", "parallelism.cp=2"])


def test_the_recorded_reasons_are_sentences_not_the_harness_output():
    """What `check` and docs/models.md quote of the matrix is said in words: no assertion text, no
    raw 'got, want' numbers (scripts/matrix_words.describe makes them at recording time)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    from matrix_words import describe

    record = json.loads((root / "raytrain_hybrid/assets/generic_families.json").read_text())
    said = [v for row in record["families"].values() for k, v in row.items() if k.endswith("reason") or k == "error"]
    assert len(said) > 100
    raw = [s for s in said if re.search(r"AssertionError|mismatches|, want |\bat 0x", s)]
    assert not raw, raw
    harness = (
        "AssertionError: 28 mismatches: gradient norm of model.layers.0.self_attn.k_proj.weight at step 0: "
        "0.2035020577474682, want 0.20352631638292648 gradient norm of model.norm.weight at step 0: 0.1, want 0.2"
    )
    assert describe(harness) == (
        "the gradient norm of model.layers.0.self_attn.k_proj.weight differs by 1.2e-04 at step 0, "
        "past the 1e-04 bound (and 27 other values past the bound)"
    )
    assert describe("AssertionError: a rank exited with -9 before reporting").startswith("a training rank was killed")


def test_the_matrix_can_put_a_hand_written_family_on_the_generic_path(monkeypatch):
    """RAYTRAIN_GENERIC_PATH (the model matrix's switch, scripts/model_matrix.py) trains a family that
    has a hand-written spec with the generic path's instead; without it the hand-written spec is used."""
    from raytrain_hybrid.models import GENERIC_PATH_ENV, get_arch
    from raytrain_hybrid.models import llama as hand_written

    assert get_arch("llama") is hand_written.SPEC
    monkeypatch.setenv(GENERIC_PATH_ENV, "llama")
    assert get_arch("llama") is not hand_written.SPEC and get_arch("llama").hf_config.func is generic.hf_config
    assert get_arch("mixtral").hf_config.func is not generic.hf_config  # not named: its own spec
    monkeypatch.delenv(GENERIC_PATH_ENV)
    assert get_arch("llama") is hand_written.SPEC


def test_a_family_without_a_pipeline_plan_trains_at_pp_1_once_the_matrix_held_it(monkeypatch):
    """HunYuan's dense model has a tensor-parallel plan and no pipeline plan: its stages are not
    known, so it runs at pp=1 (the usual embed_tokens, layers, norm) once the model matrix held it
    to its reference so, and pp > 1 is refused naming parallelism.pp; unheld, the family is refused."""
    from raytrain_hybrid.errors import ConfigError

    sizes = ["model.arch=hunyuan_v1_dense", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4"]
    monkeypatch.setattr(generic, "verified", lambda: {"hunyuan_v1_dense": {"status": "passed", "tp": True}})
    assert not generic.has_pp_plan("hunyuan_v1_dense") and generic.refusal("hunyuan_v1_dense") is None
    assert generic.pp_names("hunyuan_v1_dense") == ("embed_tokens", "layers", "norm")
    load_config(None, [*sizes, "parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1"])
    with pytest.raises(ConfigError) as err:
        load_config(None, [*sizes, "parallelism.tp=1", "parallelism.pp=2"])
    assert err.value.key == "parallelism.pp" and "no pipeline plan" in str(err.value) and "pp=1" in str(err.value)
    monkeypatch.setattr(generic, "verified", lambda: {})
    with pytest.raises(ConfigError, match="no pipeline plan in transformers"):
        load_config(None, sizes)


def test_state_space_hybrids_are_refused_by_their_config_not_their_name(monkeypatch):
    """Bamba, Jamba, Falcon-H1 and Nemotron-H hold Mamba layers under names that do not say so: their
    configs' mamba_* settings refuse them as non-decoders, recorded or not (a newer transformers' family
    is read off its classes), while a plain decoder's config passes."""
    from raytrain_hybrid.errors import ConfigError
    from raytrain_hybrid.models import generic_facts

    for mt in ("bamba", "jamba", "falcon_h1", "nemotron_h"):
        assert generic_facts.state_space(generic.classes(mt)[0]), mt
        assert "is not a transformer decoder" in generic.refusal(mt, recorded=False), mt
        with pytest.raises(ConfigError, match="is not a transformer decoder") as err:
            load_config(None, [f"model.arch={mt}", "data.path=memory"])
        assert err.value.key == "model.arch"
    assert not any(generic_facts.state_space(generic.classes(mt)[0]) for mt in ("qwen3", "lfm2", "olmo2"))
    monkeypatch.setattr(generic_facts, "recorded", lambda model_type: None)  # unrecorded: from the classes
    assert "is not a transformer decoder" in generic.refusal("bamba")


def test_a_random_weight_model_of_a_family_whose_config_names_no_layer_kinds_builds():
    """LFM2's MoE config leaves layer_types unset though its layers read it (transformers' own default
    config cannot build its model): model.* sizes alone give every layer attention, as LFM2's does."""
    sizes = ["model.arch=lfm2_moe", "model.num_layers=3", "model.hidden_size=64", "model.num_heads=4"]
    cfg = load_config(None, [*sizes, "parallelism.tp=1", "parallelism.pp=1", "parallelism.dp=1", "data.path=memory"])
    config = generic.hf_config("lfm2_moe", cfg)
    assert config.layer_types == ["full_attention"] * 3
    model = generic.build("lfm2_moe", config)
    assert len(model.model.layers) == 3


def test_a_config_with_a_width_per_layer_gives_the_widest_as_its_ffn_size():
    """Gemma 3n's intermediate_size is a list, one width a layer: the model.* size the planner reads
    is the widest (a config.json of it was refused as 'not a gemma3n_text model')."""
    conf = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 512, "intermediate_size": [128, 256, 128, 128], "num_kv_shared_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 2}  # fmt: skip
    sizes = generic.sizes_from_class("gemma3n_text", conf)
    assert sizes["ffn_hidden_size"] == 256 and sizes["num_layers"] == 4 and sizes["num_kv_heads"] == 2


@pytest.mark.parametrize("model_type", ["lfm2", "gpt_oss", "hunyuan_v1_dense"])
def test_tp_is_refused_where_the_plan_shards_no_layer(model_type):
    """transformers' plan for these shards the embedding only: at tp > 1 every rank would run every
    block whole (the planner dividing them by tp), so tp > 1 is refused naming the key; tp=1 is not."""
    from raytrain_hybrid.errors import ConfigError

    assert not any("*" in pattern for pattern in generic._tp_plan_raw(model_type))
    base = [f"model.arch={model_type}", "data.path=memory", "parallelism.pp=1", "model.seq_len=32"]
    with pytest.raises(ConfigError, match=r"no entry for its layers.*use parallelism\.tp=1") as err:
        load_config(None, [*base, "parallelism.dp=1", "parallelism.tp=2"])
    assert err.value.key == "parallelism.tp"
    load_config(None, [*base, "parallelism.dp=2", "parallelism.tp=1"])


def test_a_mixture_of_experts_takes_tp_where_its_layers_have_more_than_experts_in_the_plan(monkeypatch):
    """A mixture of experts stays whole on each tp rank (models.generic_split.moe_children), so the styles
    transformers gives its experts are not refused; a family whose plan has nothing else for its
    layers (DeepSeek-V3: latent attention outside the plan) is refused tp > 1, and so is one the model
    matrix held at tp=1 only."""
    from raytrain_hybrid.errors import ConfigError

    base = ["data.path=memory", "parallelism.pp=1", "model.seq_len=32", "parallelism.dp=1", "parallelism.tp=2"]
    assert generic_split.moe_children("qwen2_moe") == {"mlp"}
    assert set(generic_split.block_tp_plan("qwen2_moe")) == {f"self_attn.{p}_proj" for p in "qkvo"}
    assert generic.refusal("qwen2_moe", tp=2, recorded=False) is None
    assert generic_split.moe_children("deepseek_v3") == {"mlp"} and not generic_split.block_tp_plan("deepseek_v3")
    with pytest.raises(ConfigError, match=r"no entry for its layers outside its experts.*parallelism\.tp=1"):
        load_config(None, ["model.arch=deepseek_v3", *base])
    assert generic_split.moe_children("qwen3") == frozenset()
    row = {**generic.verified()["qwen2_moe"], "tp": False}
    monkeypatch.setattr(generic, "verified", lambda: {"qwen2_moe": row})
    with pytest.raises(ConfigError, match=r"held to the one-process reference at tp=1 only") as err:
        load_config(None, ["model.arch=qwen2_moe", *base])
    assert err.value.key == "parallelism.tp"


def test_expert_parallelism_is_taken_where_the_model_matrix_held_it(monkeypatch):
    """parallelism.ep on a generic mixture of experts: refused for a dense family, for one the model
    matrix did not hold with ep (its reason, else that it was not held), and at tp > 1 where it held it
    at tp=1 only; taken where it held it, ep then dividing dp and the family's own expert count."""
    from raytrain_hybrid.errors import ConfigError

    base = ["data.path=memory", "parallelism.pp=1", "model.seq_len=32", "parallelism.dp=2", "parallelism.tp=1"]
    with pytest.raises(ConfigError, match=r"qwen3's model has no experts; use ep=1"):
        load_config(None, ["model.arch=qwen3", *base, "parallelism.ep=2"])
    row = {"status": "passed", "tp": True}
    monkeypatch.setattr(generic, "verified", lambda: {"qwen2_moe": row})
    with pytest.raises(ConfigError, match=r"qwen2_moe was not held to the one-process reference with expert para"):
        load_config(None, ["model.arch=qwen2_moe", *base, "parallelism.ep=2"])
    row.update(ep=False, ep_reason="differs from the reference with ep: the loss differs")
    with pytest.raises(ConfigError, match=r"qwen2_moe differs from the reference with ep: the loss differs; use"):
        load_config(None, ["model.arch=qwen2_moe", *base, "parallelism.ep=2"])
    row.update(ep=True, ep_reason=None, ep_tp_reason="differs from the reference at tp=2: the loss differs")
    with pytest.raises(ConfigError, match=r"with ep differs from the reference at tp=2.*use parallelism.tp=1 or ep=1"):
        load_config(None, ["model.arch=qwen2_moe", *base[:-1], "parallelism.tp=2", "parallelism.ep=2"])
    from raytrain_hybrid.models import get_arch

    get_arch.cache_clear()  # (the spec read the verdict when first asked for)
    cfg = load_config(None, ["model.arch=qwen2_moe", *base, "parallelism.ep=2"])
    spec = get_arch("qwen2_moe")
    assert spec.moe == {"experts": "mlp.experts"} and spec.experts(cfg.model) == (60, 4)  # (the class's defaults)
    with pytest.raises(ConfigError, match=r"parallelism.ep=8: must divide parallelism.dp=4"):
        load_config(
            None, ["model.arch=qwen2_moe", *base[:3], "parallelism.dp=4", "parallelism.tp=1", "parallelism.ep=8"]
        )


def test_the_planner_keeps_a_generic_mixture_of_experts_whole_on_tp_and_splits_its_experts_over_ep():
    """Qwen2-MoE's predicted weights per rank: tp divides attention and the rest of the block only
    (its router, shared expert and experts stay whole on every tp rank), ep then divides the experts
    module alone (not the router, not the shared expert)."""
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import PROFILES

    base = ["model.arch=qwen2_moe", "data.path=memory", "model.seq_len=32", "parallelism.dp=2", "parallelism.pp=1"]
    weights = {
        (tp, ep): predict(load_config(None, [*base, f"parallelism.tp={tp}", f"parallelism.ep={ep}"]), PROFILES["h100"])[
            "memory_bytes"
        ]["params"]
        / 4  # (fp32: 4 bytes a parameter)
        for tp, ep in ((1, 1), (2, 1), (2, 2))
    }
    cfg = load_config(None, [*base, "parallelism.tp=1"])
    spec, blocks = get_arch("qwen2_moe"), cfg.model.num_layers
    experts, rest = spec.expert_params(cfg.model) * blocks, spec.whole_params(cfg.model) * blocks
    assert experts > 0 and rest > 0
    assert weights[(2, 1)] == pytest.approx((weights[(1, 1)] - experts - rest) / 2 + experts + rest)
    assert weights[(2, 2)] == pytest.approx(weights[(2, 1)] - experts / 2)


@pytest.mark.parametrize(("sp", "share"), [(False, 2 / 4), (True, 3 / 4)])
def test_the_planner_charges_tp_collectives_of_a_mixture_of_experts_where_they_are(sp, share):
    """At tp=2 a Qwen2-MoE block's MoE runs whole on every rank: attention keeps its all-reduce
    forward and backward, the MoE has none of its own (with sequence parallelism its input's
    all-gather forward and reduce-scatter backward): half a dense Qwen2 block's TP time of the same
    sizes, or three quarters."""
    from raytrain_hybrid.planner.cost import predict
    from raytrain_hybrid.planner.hardware import PROFILES

    sizes = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2"]
    base = [*sizes, "data.path=memory", "model.seq_len=64", "parallelism.dp=1", "parallelism.pp=1", "parallelism.tp=2"]
    base.append(f"parallelism.sequence_parallel={str(sp).lower()}")
    tp_time = {
        arch: predict(load_config(None, [f"model.arch={arch}", *base]), PROFILES["h100"])["time_s"]["tp"]
        for arch in ("qwen2", "qwen2_moe")
    }
    assert tp_time["qwen2"] > 0 and tp_time["qwen2_moe"] == pytest.approx(share * tp_time["qwen2"])


def test_a_family_that_norms_its_embeddings_with_its_final_norm_does_so_on_the_first_stage(tmp_path, monkeypatch):
    """NanoChat's base model passes the embeddings through its final norm (weightless) before the
    layers, as well as the last hidden states: recorded as pre_norm (and read off its classes alike),
    the norm kept on every stage, and the engine's stage gives transformers' logits. The negative
    control: without that norm they differ (the model matrix refused the family so: 0.98 of the logits)."""
    from test_models import _stage_of, make_checkpoint

    from raytrain_hybrid.models import generic_facts, get_arch

    assert generic_facts.pre_norm("nanochat") and not generic_facts.pre_norm("qwen3")
    assert generic_facts.norms_embeddings("nanochat", "layers", "norm")
    assert not generic_facts.norms_embeddings("qwen3", "layers", "norm")
    assert get_arch("nanochat").last_stage == ("lm_head",) and "model.norm" in get_arch("qwen3").last_stage
    stage, reference = _stage_of(make_checkpoint(tmp_path, "nanochat"))
    ids = torch.randint(3, reference.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    def gap() -> float:
        with torch.no_grad():
            got, want = stage(ids), reference(input_ids=ids).logits
        return float((got - want).norm() / want.norm())

    assert gap() < 1e-5
    monkeypatch.setattr(generic_facts, "pre_norm", lambda model_type: False)
    assert gap() > 0.1


def test_a_family_whose_attention_reads_its_causal_mask_runs_eager(tmp_path, monkeypatch):
    """Doge's attention builds a dynamic mask from the causal mask it is given, and SDPA's causal
    path gives none: the model matrix recorded it to run transformers' eager attention (a mask
    tensor), where the engine's stage gives transformers' logits; with SDPA it does not."""
    from test_models import _stage_of, make_checkpoint

    row = generic.verified()["doge"]
    assert row["attention"] == "eager" and generic.attention_implementation("doge") == "eager"
    path = make_checkpoint(tmp_path, "doge")
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def gap() -> float:
        stage, reference = _stage_of(path)
        with torch.no_grad():
            got, want = stage(ids), reference(input_ids=ids).logits
        return float((got - want).norm() / want.norm())

    assert gap() < 1e-5
    # Its mixture of experts (is_moe) routes by the whole batch: a checkpoint that turns it on is refused
    import json

    from raytrain_hybrid.errors import ConfigError

    overrides = ["parallelism.tp=1", "parallelism.pp=1", "data.path=memory", "model.seq_len=32"]
    load_config(None, [*overrides, f"model.pretrained={path}", "lora.rank=4"])  # (dense: LoRA held)
    moe = tmp_path / "doge-moe"
    moe.mkdir()
    for f in path.iterdir():
        (moe / f.name).write_bytes(f.read_bytes())
    (moe / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), "is_moe": True}))
    with pytest.raises(ConfigError, match="sets is_moe, which turns on Doge's mixture of experts") as err:
        load_config(None, [*overrides, f"model.pretrained={moe}"])
    assert err.value.key == "model.pretrained"
    rows, sdpa = generic.verified(), {k: v for k, v in row.items() if k != "attention"}
    monkeypatch.setattr(generic, "verified", lambda: {**rows, "doge": sdpa})
    assert generic.attention_implementation("doge") == "sdpa" and gap() > 0.1
