"""Packed sequences (data.packing): several whole examples a row, each attending only to itself.

The oracle (tests/reference_packing.py) runs every example alone through an unmodified
transformers model and sums the same tokens. A packed row must give each of its examples'
tokens the logits that example gives alone (test_a_packed_row_is_each_example_alone), and every
layout, pipeline, tensor and sequence parallel and ZeRO included, must train what the reference
trains on the same examples (losses, every parameter's gradient norm, final weights), with the
rows read in each process or streamed by a replica's leader and broadcast. The single-process
model is the first test's; the layouts run as four gloo processes in one launch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_data import VOCAB, conversations, make_tokenizer, write_chat
from gloo_harness import launch_ranks
from reference import _buffer_shuffle, corpus_tokens, lm_model
from reference_chat import chat_examples
from reference_packing import one_thread, packed_reference_run, packed_steps, summed_loss, text_examples
from test_oracle import assert_oracle, layout

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

SEQ = 128
STEPS = 3
COMMON = (
    f"train.steps={STEPS}",
    "model.num_layers=2",
    "model.hidden_size=64",
    "train.global_batch_size=8",
    f"model.seq_len={SEQ}",
    "data.packing=true",
)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packing")
    make_tokenizer(out / "tok")
    write_chat(out / "chat.parquet", conversations(90))
    return out


def _sets(chat_dir: Path, *extra: str) -> list[str]:
    return [
        *COMMON,
        "data.format=chat",
        f"data.path={chat_dir / 'chat.parquet'}",
        f"data.tokenizer={chat_dir / 'tok'}",
        f"model.vocab_size={VOCAB}",
        "data.shuffle_buffer=16",
        *extra,
    ]


def _examples(chat_dir: Path) -> list:
    return chat_examples(chat_dir / "tok", chat_dir / "chat.parquet", SEQ)


def _engine_batches(cfg, steps: int) -> list:
    """The engine's replica batches (dp=1) of the first ``steps`` steps, read without Ray."""
    from raytrain_hybrid.data.examples import in_memory_examples

    next_batch = in_memory_examples(cfg, 1, 0)
    return [next_batch(k) for k in range(steps)]


def _split(batch) -> list[tuple[list, list]]:
    """A packed batch's examples as (token ids, counted labels), read off the position ids."""
    out = []
    for ids, pos, labels in zip(batch.inputs[0], batch.inputs[1], batch.labels, strict=True):
        starts = [*torch.nonzero(pos == 0).flatten().tolist(), len(pos)]
        for a, b in zip(starts, starts[1:], strict=False):
            assert pos[a:b].tolist() == list(range(b - a))
            out.append((ids[a:b].tolist(), labels[a:b].tolist()))
    return out


def test_packed_rows_hold_whole_examples_with_their_masks(chat_dir):
    """Each step's rows hold exactly the examples the reference's first fit puts in its global
    batch, each whole, its positions from 0, its label mask kept, no label across a boundary;
    what is left of a row is padding (id 0, never counted), under 10 % here."""
    cfg = load_config(None, _sets(chat_dir))
    want = packed_steps(cfg, _examples(chat_dir), _buffer_shuffle)
    padding = 0
    for batch, examples in zip(_engine_batches(cfg, STEPS), want, strict=True):
        assert batch.input_ids.shape == batch.inputs[1].shape == (8, SEQ)
        got = _split(batch)
        real = [g for g in got if any(g[0])]  # padding: all id 0
        padding += sum(len(g[0]) for g in got if not any(g[0]))
        assert len(real) == len(examples)
        for (ids, labels), (want_ids, mask) in zip(real, examples, strict=True):
            # An example's inputs are its tokens but the last (the row's last label may be its own).
            n = len(ids)
            assert ids == list(want_ids[:n]) and n >= len(want_ids) - 1
            counted = [t if m else -100 for t, m in zip(want_ids[1:], mask[1:], strict=True)]
            assert labels[: n - 1] == counted[: n - 1]
            if n == len(want_ids):  # the label after its last token is the next one's first: not counted
                assert labels[n - 1] == -100
        assert all(label == -100 for g in got if not any(g[0]) for label in g[1])
    assert 0 < padding < 0.1 * STEPS * 8 * SEQ


def test_a_resumed_packed_stream_stands_where_the_checkpoint_recorded(chat_dir):
    """A resume skips the steps done by packing the same rows again: after skipping 3 steps the
    stream stands where the run recorded it (what the replica feed checks against the manifest)
    and goes on with step 4's rows."""
    import numpy as np

    from raytrain_hybrid.data.local_rows import train_rows
    from raytrain_hybrid.data.stream import replica_stream

    cfg = load_config(None, _sets(chat_dir, "data.shuffle_buffer=4"))
    rows = train_rows(cfg)
    full = replica_stream(cfg, rows, dp=1, dp_rank=0)
    steps = iter(full)
    for _ in range(3):
        next(steps)
    recorded = full.position.manifest_entry()
    fourth = next(steps)
    resumed = replica_stream(cfg, rows, dp=1, dp_rank=0, skip_steps=3)
    first = next(iter(resumed))
    assert resumed.position.skipped_to == recorded and recorded["documents_in_epoch"] > recorded["windows_in_epoch"]
    assert all(np.array_equal(first[k], fourth[k]) for k in ("tokens", "label_mask", "positions"))


@functools.lru_cache(maxsize=2)
def _models(arch: str):
    """The engine's one-stage model and the transformers reference, with the same weights."""
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    cfg = load_config(
        None, [f"model.arch={arch}", "model.num_layers=2", "model.hidden_size=64", f"model.seq_len={SEQ}"]
    )
    torch.manual_seed(1)
    reference = lm_model(cfg).float()
    state = reference.state_dict()
    spec = get_arch(arch)
    hf_config = spec.hf_config(cfg)
    stage = build_stage(spec, hf_config, list(range(2)), first=True, last=True)
    stage.to_empty(device="cpu")
    if spec.init_buffers is not None:
        spec.init_buffers(stage, hf_config, torch.device("cpu"))
    if arch == "gpt2":
        from reference import gpt2_to_engine

        state = gpt2_to_engine(state)
    stage.load_state_dict(state, strict=True)
    return cfg, stage, reference


def _row_examples(ids, pos, labels) -> list[tuple[np.ndarray, np.ndarray]]:
    """A packed row's examples (padding too) as (tokens, mask): each one's tokens and the label
    after its last (the row's next token: counted only where the example ends the row)."""
    out = []
    starts = [*torch.nonzero(pos == 0).flatten().tolist(), len(pos)]
    for a, b in zip(starts, starts[1:], strict=False):
        tokens = torch.cat([ids[a:b], labels[b - 1 : b].clamp(min=0)])
        mask = torch.cat([torch.zeros(1), (labels[a:b] != -100).float()])
        out.append((tokens.numpy(), mask.numpy()))
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_packed_row_is_each_example_alone(arch):
    """Two rows of documents of the shipped corpus (text, long ones in pieces): the engine's
    logits at every token of every example equal those of the example run alone through the
    transformers model; the mean loss of the counted tokens and every parameter's gradient
    equal those of the examples run alone. Without the position ids (one causal sequence) the
    second example of a row is off: the comparison sees the difference."""
    with one_thread():
        _a_packed_row_is_each_example_alone(arch)


def _a_packed_row_is_each_example_alone(arch):
    _, stage, reference = _models(arch)
    cfg = load_config(None, [f"model.arch={arch}", *COMMON[2:], "data.path=memory"])
    batch = _engine_batches(cfg, 1)[0]
    ids, pos, labels = batch.inputs[0][:2], batch.inputs[1][:2], batch.labels[:2]
    logits = stage(ids, pos)
    examples = [e for r in range(2) for e in _row_examples(ids[r], pos[r], labels[r])]
    assert len(examples) >= 5, "several examples a row"
    for r in range(2):
        starts = [*torch.nonzero(pos[r] == 0).flatten().tolist(), SEQ]
        for a, b in zip(starts, starts[1:], strict=False):
            alone = reference(input_ids=ids[r : r + 1, a:b]).logits[0]
            torch.testing.assert_close(logits[r, a:b], alone, rtol=1e-5, atol=1e-5)
    starts = torch.nonzero(pos[0] == 0).flatten().tolist()
    whole = stage(ids[:1])[0]  # no position ids: one causal sequence
    assert (whole[starts[1] : starts[2]] - logits[0, starts[1] : starts[2]]).abs().max() > 1e-2

    count = int((labels != -100).sum())
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
    stage.zero_grad()
    loss.backward()
    reference.zero_grad()
    want, want_count = summed_loss(reference, examples)
    (want / want_count).backward()
    assert want_count == count
    torch.testing.assert_close(loss, want / count, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    if arch == "gpt2":
        from reference import gpt2_to_engine

        grads = gpt2_to_engine(grads)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_packed_text_examples_are_the_corpus_documents():
    """Raw text packed (data.path=memory): the rows hold the shipped corpus's documents, each
    ending in EOT, one longer than a row in pieces overlapping by one token."""
    from tokenizers import Tokenizer

    from raytrain_hybrid.data.tokenizer import DEFAULT_TOKENIZER, EOT

    cfg = load_config(None, [*COMMON, "data.path=memory", "data.shuffle_buffer=0"])
    eot = Tokenizer.from_file(str(DEFAULT_TOKENIZER)).token_to_id(EOT)
    want = packed_steps(cfg, text_examples(corpus_tokens(), eot, SEQ + 1), _buffer_shuffle)
    assert any(len(e[0]) == SEQ + 1 for e in want[0]), "a document split into pieces of a whole row"
    for batch, examples in zip(_engine_batches(cfg, 2), want[:2], strict=True):
        real = [g for g in _split(batch) if any(g[0])]
        assert [ids for ids, _ in real] == [list(e[0][: len(ids)]) for (ids, _), e in zip(real, examples, strict=True)]


# ------------------------------------------------------------------ every layout, as gloo processes


LAYOUTS = {
    # tp=2 with sequence parallelism and a pipeline: position ids travel stage to stage.
    "1x2x2-1f1b-m2": layout(1, 2, 2, "1F1B", 2),
    "2x2x1-zero3": layout(2, 2, 1, microbatches=2, zero=3),
    "2x1x2-zero1-gpipe": layout(2, 1, 2, "GPipe", 2, 1),
}
# Read as a Ray run reads: each replica's leader streams the rows (here data.path encoded in the
# process, standing in for Ray Data's iterator) and broadcasts tokens, masks and positions.
FED = {"1x2x2-1f1b-m2", "2x1x2-zero1-gpipe"}


def _run_jobs(rank: int, world: int, jobs: dict) -> dict:
    """gloo_harness's jobs in one launch, some fed through the replica feed (run_worker's dataset_fn)."""
    from gloo_harness import Probe

    from raytrain_hybrid.data.local_rows import train_rows
    from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
    from raytrain_hybrid.engine.trainer import Trainer
    from raytrain_hybrid.engine.worker import run_worker

    out, init = {}, Trainer.__init__
    for name, (overrides, fed) in jobs.items():
        probe = Probe()
        probe.install()
        try:
            cfg = load_config(None, overrides)
            feed = WorkerIO(dataset_fn=functools.partial(train_rows, cfg) if fed else None)
            result = run_worker(WorkerPlan(cfg), "node0", feed)
        finally:
            Trainer.__init__ = init
        out[name] = {**result, "probe": probe.report()}
    return out


_REFERENCES: dict = {}


def _reference(chat_dir: Path, sets: list[str], initial: dict) -> list[dict]:
    """The reference run for ``sets`` from ``initial``: the engine's initial state as a run's
    probe gathered it (the init rule itself is tests/test_oracle.py's), computed once."""
    key = tuple(sets)
    if key not in _REFERENCES:
        cfg = load_config(None, list(sets))
        steps = packed_steps(cfg, _examples(chat_dir), _buffer_shuffle)
        _REFERENCES[key] = packed_reference_run(cfg, steps, initial)
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def layout_runs(chat_dir) -> dict[str, dict]:
    sets = _sets(chat_dir)
    jobs = {name: ([*sets, *overrides], name in FED) for name, overrides in LAYOUTS.items()}
    jobs["gpt2-1x2x2"] = ([*_sets(chat_dir, "model.arch=gpt2"), *layout(1, 2, 2, "1F1B", 2)], False)
    return launch_ranks(_run_jobs, 4, jobs)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_layout_matches_each_example_alone(chat_dir, layout_runs, name):
    """Each layout starts where the first does and trains what the reference trains from there:
    the same losses, gradient norms of every parameter, final weights."""
    initial = layout_runs[sorted(LAYOUTS)[0]]["probe"]["initial"]
    assert_oracle(layout_runs[name], _reference(chat_dir, _sets(chat_dir), initial))
    # Fed runs report where the replica's stream stands: rows (packed sequences) of its epoch.
    assert all(("data_windows_in_epoch" in h) == (name in FED) for h in layout_runs[name]["history"])
    counted = [len([m for m in mask[1:] if m]) for _, mask in _examples(chat_dir)]
    assert all(0 < h["loss_tokens"] < sum(counted) for h in layout_runs[name]["history"])


def test_packed_gpt2_matches_each_example_alone(chat_dir, layout_runs):
    run = layout_runs["gpt2-1x2x2"]
    assert_oracle(run, _reference(chat_dir, _sets(chat_dir, "model.arch=gpt2"), run["probe"]["initial"]))


# ------------------------------------------------------------------ refusals


def test_packed_rows_that_fill_no_global_batch_are_refused_before_workers_start(chat_dir):
    """The input check packs the rows' lengths as the stream packs the rows: 90 conversations
    fill fewer sequences than a global batch of 48 (unpacked, 90 rows fill one), said with the
    count the stream makes in the stored order."""
    import re

    from raytrain_hybrid.data.local_rows import train_rows
    from raytrain_hybrid.data.stream import replica_stream
    from raytrain_hybrid.launch.plan.inputs import prepare_input

    sets = _sets(chat_dir, "train.global_batch_size=48", "data.shuffle_buffer=0")
    with pytest.raises(ConfigError) as err:
        prepare_input(load_config(None, sets), say=print)
    assert err.value.key == "train.global_batch_size" and "data.packing=true" in str(err.value)
    rows = int(re.search(r"pack into (\d+) sequences", str(err.value)).group(1))
    prepare_input(load_config(None, [*sets, "data.packing=false"]), say=print)
    one = ["train.global_batch_size=1", "data.shuffle_buffer=0", "data.epochs=1", *layout(1, 1, 1, microbatches=1)]
    cfg = load_config(None, _sets(chat_dir, *one))
    assert sum(1 for _ in replica_stream(cfg, train_rows(cfg), dp=1, dp_rank=0)) == rows


def test_packing_is_refused_for_classifiers_and_on_a_resume_that_changes_it():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.arch=multimodal-bert", "model.pretrained=none", "data.packing=true"])
    assert err.value.key == "data.packing" and "language models" in str(err.value)

    from raytrain_hybrid.checkpoint.trajectory import check_trajectory, describe

    before = load_config(None, ["data.path=memory"])
    manifest = {"trajectory": describe(before)}
    after = load_config(None, ["data.path=memory", "data.packing=true"])
    with pytest.raises(ConfigError) as err:
        check_trajectory(after, manifest, "ckpt", [])
    assert err.value.key == "data.packing" and "--allow-change data.packing" in str(err.value)
    assert check_trajectory(after, manifest, "ckpt", ["data.packing"]) == ["data.packing"]
