"""Context parallelism (parallelism.cp): the oracle over (dp, cp, tp, pp) layouts, the refusals
before any worker starts, where the cp groups land on nodes.

The oracle cases run grouped-query attention (num_kv_heads=2 of 4 heads): at cp=2 the key/value
heads divide, at cp=4 (and at tp=2, cp=2) they are repeated before the all-to-all.
"""

from __future__ import annotations

import json

import pytest
from conftest import reference_history
from gloo_harness import run_gloo_jobs
from test_oracle import MEMORY, SHORT, assert_oracle, assert_replicas_share_rows, layout

from raytrain_hybrid import cli

BASE = (*SHORT, *MEMORY, "model.num_kv_heads=2")


def cp_layout(dp: int, cp: int, tp: int, pp: int, zero: int = 0, schedule: str = "1F1B") -> list[str]:
    return [*layout(dp, tp, pp, schedule, 2, zero), f"parallelism.cp={cp}"]


# (dp, cp, tp, pp): cp=4 alone; cp with dp under each ZeRO stage (ZeRO-1 slicing the optimizer over dp x cp,
# ZeRO-2 and -3 FSDP sharded over dp x cp; ZeRO-1 at cp=4 at the resume below); cp with tp (sequence parallelism
# inside each cp slice); the all-to-alls recomputed in backward under selective activation checkpointing.
WORLD4 = {
    "1x4x1x1-selective-ac": [*cp_layout(1, 4, 1, 1), "parallelism.activation_checkpointing=selective"],
    "2x2x1x1-zero1": cp_layout(2, 2, 1, 1, zero=1),
    "2x2x1x1-zero2": cp_layout(2, 2, 1, 1, zero=2),
    "2x2x1x1-zero3": cp_layout(2, 2, 1, 1, zero=3),
    "1x2x2x1-sp": cp_layout(1, 2, 2, 1),
}
# cp with tp and pp together, docs/parallelism.md's example layout (dp=1 cp=2 tp=2 pp=2), under full activation
# checkpointing: sequence parallelism inside each cp slice, each slice's activations crossing the stages.
WORLD8 = {"1x2x2x2-1f1b-ac": [*cp_layout(1, 2, 2, 2), "parallelism.activation_checkpointing=true"]}
LAYOUTS = WORLD4 | WORLD8


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory) -> dict:
    """The WORLD4 layouts in one launch of 4 gloo ranks; the ZeRO-3 one saves a checkpoint at step 2,
    and a last job resumes from it at cp=4 under ZeRO-1. Then WORLD8 on 8 ranks."""
    out = tmp_path_factory.mktemp("cp")
    saved = [f"run.output_dir={out / 'saved'}", "checkpoint.interval=2"]
    jobs = {name: [*BASE, *overrides, *(saved if name == SAVES else ())] for name, overrides in WORLD4.items()}
    jobs["resumed-1x4x1x1-zero1"] = {
        "overrides": [*BASE, *cp_layout(1, 4, 1, 1, zero=1), f"run.output_dir={out / 'resumed'}"],
        "resume": str(out / "saved" / "checkpoints" / "step_2"),
    }
    return run_gloo_jobs(4, jobs) | run_gloo_jobs(8, {name: [*BASE, *o] for name, o in WORLD8.items()})


SAVES = "2x2x1x1-zero3"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cp_layouts_match_single_process(cp_runs, name):
    """Losses, every parameter's gradient norm and the final weights equal the single-process run."""
    assert_oracle(cp_runs[name], reference_history(BASE, "memory"))
    # Every rank of a replica (its cp ranks too) read the same rows, each cp rank its own slice of them.
    per_rank = cp_runs[name]["memory"]
    assert_replicas_share_rows(per_rank, LAYOUTS[name])
    cp = int(name.split("x")[1])
    assert sorted(r["cp"] for r in per_rank) == sorted(list(range(cp)) * (len(per_rank) // cp))


def test_cp_checkpoint_resumes_under_another_cp_layout(cp_runs):
    """Saved at dp=2 x cp=2 under FSDP (sharded over dp x cp), resumed at cp=4 under ZeRO-1: the
    resumed steps equal the uninterrupted single-process run's."""
    assert_oracle(cp_runs["resumed-1x4x1x1-zero1"], reference_history(BASE, "memory"), first=2)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from chat_data import conversations, make_tokenizer, write_chat

    out = tmp_path_factory.mktemp("cp-packing")
    make_tokenizer(out / "tok")
    write_chat(out / "chat.parquet", conversations(90))
    return out


def test_cp_with_packing_matches_each_example_alone(chat_dir):
    """Packed chat rows (data.packing) split over cp ranks, through a pipeline: each rank's slice of
    the position ids gives RoPE its positions and travels stage to stage; attention rebuilds the
    document mask of the whole rows. The reference runs every example alone (tests/reference_packing.py)."""
    from chat_data import VOCAB
    from reference import _buffer_shuffle
    from reference_chat import chat_examples
    from reference_packing import packed_reference_run, packed_steps
    from test_models import make_checkpoint

    from raytrain_hybrid.config import load_config

    seq = 128
    sets = [
        "train.steps=3",
        "model.num_layers=2",
        "model.hidden_size=64",
        "train.global_batch_size=8",
        f"model.seq_len={seq}",
        "data.packing=true",
        "data.format=chat",
        f"data.path={chat_dir / 'chat.parquet'}",
        f"data.tokenizer={chat_dir / 'tok'}",
        f"model.vocab_size={VOCAB}",
        "data.shuffle_buffer=16",
    ]
    # And a transformers family on the generic path, from its checkpoint: Gemma 3's sliding layers
    # masked over the whole packed rows (models.generic_forward), in the same launch.
    gemma = make_checkpoint(chat_dir, "gemma3_text", vocab=VOCAB)
    generic = [*(s for s in sets if not s.startswith("model.")), f"model.seq_len={seq}", f"model.pretrained={gemma}"]
    jobs = {"1x2x1x2": [*sets, *cp_layout(1, 2, 1, 2)], "gemma3_text": [*generic, *cp_layout(1, 2, 1, 2)]}
    runs = run_gloo_jobs(4, jobs)
    examples = chat_examples(chat_dir / "tok", chat_dir / "chat.parquet", seq)
    for name, overrides in (("1x2x1x2", sets), ("gemma3_text", generic)):
        # (at the run's tp=1: check refuses Gemma 3's packing at tp > 1, the default layout's)
        cfg = load_config(None, [*overrides, "parallelism.tp=1"])
        steps = packed_steps(cfg, examples, _buffer_shuffle)
        # From the run's own initial state (the init rule is tests/test_oracle.py's to check).
        assert_oracle(runs[name], packed_reference_run(cfg, steps, runs[name]["probe"]["initial"]))


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["parallelism.cp=3"], "model.seq_len=32"),  # cp must divide the sequence
        (["parallelism.cp=4", "parallelism.tp=2", "model.seq_len=36"], "cp*tp=8"),  # SP splits each cp slice
        (["parallelism.cp=4", "parallelism.tp=2"], "model.num_heads/tp=4/2=2"),  # heads shared by cp ranks
        (["parallelism.cp=2", "model.arch=multimodal-bert"], "no context-parallel attention"),
        (["parallelism.cp=2", "model.arch=gpt2"], "no context-parallel attention"),
        (["parallelism.cp=0"], ">= 1"),
    ],
)
def test_bad_cp_is_refused_before_workers_start(overrides, says, capsys):
    args = ["check", "--topology", "64", "--set", "model.seq_len=32", "--set", "parallelism.pp=1"]
    for o in overrides:
        args += ["--set", o]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "parallelism.cp" in err and says in err, err


def test_check_places_cp_next_to_tp(capsys):
    """cp x tp inside a node where it fits; across nodes otherwise, and `check` says which."""
    base = ["check", "--set", "parallelism.dp=1", "--set", "parallelism.pp=2", "--set", "parallelism.tp=2"]
    base += ["--set", "parallelism.cp=2", "--set", "model.seq_len=32"]
    assert cli.main([*base, "--topology", "4,4"]) == 0
    out = capsys.readouterr().out
    assert "cp=2" in out and "cp groups stay inside a node" in out, out
    assert cli.main([*base, "--topology", "2,2,2,2"]) == 0
    out = capsys.readouterr().out
    assert "cp groups cross nodes" in out, out
    assert cli.main([*base, "--topology", "4,4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ranks = {r["rank"]: r for r in report["ranks"]}
    for group in report["groups"]["cp"]:
        assert len(group) == 2 and len({ranks[r]["node"] for r in group}) == 1
        assert sorted(ranks[r]["cp"] for r in group) == [0, 1]
    for group in report["groups"]["tp"]:
        assert len({ranks[r]["node"] for r in group}) == 1


def test_start_line_says_where_cp_groups_run():
    """The driver's start line, before workers start: cp beside dp, tp and pp, and whether the cp
    groups' all-to-alls stay inside a node."""
    from types import SimpleNamespace

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.runtime.start import RunPlan

    cfg = load_config(None, ["parallelism.dp=1", "parallelism.cp=2", "parallelism.tp=2", "model.seq_len=32"])
    lines = {}
    for nodes in ([4, 4], [2, 2, 2, 2]):
        plan = RunPlan(
            cfg=cfg,
            point=SimpleNamespace(path=None, step=0),
            reach=None,
            use_gpu=False,
            resources={"CPU": 1},
            counts=[8],
            placement=nodes,
            layout_hw=None,
            end=5,
        )
        (lines[len(nodes)],) = plan.lines()
    assert lines[2].startswith("start: dp=1 cp=2 tp=2 pp=2, 8 workers") and "inside a node" in lines[2]
    assert "cp groups cross nodes" in lines[4]


def test_a_cp_run_asks_ray_for_every_rank_and_reports_cp():
    """Ray Train starts dp*cp*tp*pp workers (one replica is cp*tp*pp of them); summary.json's layout names cp."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.plan.elastic import scaling_workers
    from raytrain_hybrid.launch.records.summary import summarize

    cfg = load_config(None, ["parallelism.dp=2", "parallelism.cp=2", "parallelism.tp=2", "model.seq_len=32"])
    assert scaling_workers(cfg) == {"num_workers": 16} and cfg.parallelism.world_size == 16
    layout = summarize(cfg, [], [])["layout"]
    assert layout["cp"] == 2 and (layout["dp"], layout["tp"], layout["pp"]) == (2, 2, 2)


# An 8B Llama (Llama 3 sizes) at a 128k-token sequence on one node of 8 H100s (the planner's profile).
LONG = {
    "model.arch": "llama",
    "model.hidden_size": 4096,
    "model.ffn_hidden_size": 14336,
    "model.num_layers": 32,
    "model.num_heads": 32,
    "model.num_kv_heads": 8,
    "model.vocab_size": 128256,
    "model.seq_len": 131072,
    "train.global_batch_size": 1,
    "train.dtype": "bfloat16",
    "parallelism.dp": 1,
    "parallelism.tp": 1,
    "parallelism.pp": 1,
    "parallelism.microbatches": 1,
}


def _sets(values: dict) -> list[str]:
    return [arg for k, v in values.items() for arg in ("--set", f"{k}={v}")]


def test_planner_fits_a_long_sequence_with_cp_only(capsys):
    """No layout without cp fits the 128k sequence in an H100's memory; cp=4 does (activations
    and logits / cp), and `plan` shows the cp column."""
    args = ["plan", "--world-size", "8", "--gpus-per-node", "8", "--hardware", "h100", *_sets(LONG)]
    assert cli.main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    no_cp = [r for r in rows if r["cp"] == 1]
    assert no_cp and not any(r["feasible"] for r in no_cp)
    assert min(r["memory_bytes"]["total"] for r in no_cp) > 80e9
    fits = [r for r in rows if r["cp"] == 4 and r["feasible"]]
    assert fits, "cp=4 should fit"
    assert cli.main([*args, "--top", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:4] == ["dp", "cp", "tp", "pp"]


def test_layout_auto_chooses_cp_for_a_long_sequence(capsys):
    args = ["check", "--hardware", "h100", "--topology", "8", *_sets(LONG)]
    args += _sets({"parallelism.layout": "auto", "cluster.use_gpu": "true"})
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    picked = next(line for line in out.splitlines() if line.startswith("layout ok:"))
    assert " cp=" in picked and "cp=1 " not in picked, out
    assert "(fits)" in out


def test_sweep_runs_the_cp_layouts_the_planner_fits():
    """`sweep`'s trials (the layout enumeration, no Ray): at the 128k sequence only cp layouts
    fit, and the trials are those, each pinning its cp (dp*cp*tp*pp = world), named and printed
    with it; a model without a cp attention gets none."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.planner.hardware import PROFILES
    from raytrain_hybrid.tools.sweep import TRIAL_KEYS, _name, plan_trials, set_line

    cfg = load_config(None, [f"{k}={v}" for k, v in LONG.items()])
    trials = plan_trials(cfg, 8, PROFILES["h100"], top=3)
    assert len(trials) == 3 and all(t["cp"] > 1 and t["feasible"] for t in trials), trials
    for t in trials:
        layout = {k: t[k] for k in TRIAL_KEYS}
        assert layout["dp"] * layout["cp"] * layout["tp"] * layout["pp"] == 8
        assert f"-cp{t['cp']}-" in _name(layout) and f"--set parallelism.cp={t['cp']}" in set_line(layout)
    (pinned,) = plan_trials(cfg, 8, PROFILES["h100"], top=3, only=[{"cp": 2, "tp": 2}])
    assert (pinned["cp"], pinned["tp"]) == (2, 2)
    gpt2 = load_config(None, ["model.arch=gpt2", "model.seq_len=4096"])
    assert all(t["cp"] == 1 for t in plan_trials(gpt2, 2, PROFILES["h100"], top=100))
    assert " cp=" not in set_line(plan_trials(gpt2, 2, PROFILES["h100"], top=1)[0])


def test_an_elastic_run_keeps_cp_and_resizes_dp():
    """parallelism.min_dp with cp=2: a replica is cp*tp*pp workers, Ray is asked for whole
    replicas at the usable dp values, and each start takes dp = workers // (cp*tp*pp) with cp
    kept (the restart itself, dp=3 -> 2 at cp=2, is held to the oracle in tests/test_elastic.py)."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.config.elastic import at_world, describe, usable_dps
    from raytrain_hybrid.launch.plan.elastic import scaling_workers, start_line, worker_counts

    sets = ["model.seq_len=32", "train.global_batch_size=12", "parallelism.dp=3", "parallelism.min_dp=1"]
    sets += ["parallelism.microbatches=2"]
    cfg = load_config(None, [*sets, "parallelism.cp=2", "parallelism.tp=1", "parallelism.pp=1"])  # not refused
    assert usable_dps(cfg.parallelism) == [1, 2, 3]
    assert worker_counts(cfg) == [2, 4, 6] and scaling_workers(cfg) == {"num_workers": (2, 6)}
    two = at_world(cfg, 4).parallelism
    assert (two.dp, two.cp, two.microbatches) == (2, 2, 3)
    with pytest.raises(ValueError, match=r"multiple of cp\*tp\*pp=2"):
        at_world(cfg, 5)
    assert "(2 workers a replica)" in describe(cfg) and "(2 workers a replica)" in start_line(cfg)
    pp2 = load_config(None, [*sets, "parallelism.cp=2", "parallelism.tp=2", "parallelism.pp=2"])
    assert worker_counts(pp2) == [8, 16, 24]
