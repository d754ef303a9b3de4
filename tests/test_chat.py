"""Fine-tuning data (data.format=chat / prompt_completion): the loss counts assistant tokens
only, and every layout trains the model a plain single-process loop trains.

The conversations' answers differ in length, so micro-batches and replicas hold different
numbers of counted tokens: a mean per micro-batch (or per replica) would train another model,
and test_a_mean_per_micro_batch_would_differ shows these data tell the two apart. The reference
(tests/reference_chat.py) renders the chat template and finds the assistant tokens itself.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chat_data import VOCAB, conversations, make_tokenizer, write_chat, write_prompt_completion
from gloo_harness import initial_state, run_gloo, run_gloo_jobs
from reference_chat import (
    batches,
    chat_examples,
    masked_reference_run,
    mean_of_split_means,
    prompt_completion_examples,
)
from test_oracle import RTOL, assert_oracle, layout

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

SEQ = 64
STEPS = 3
COMMON = (f"train.steps={STEPS}", "model.num_layers=4", "train.global_batch_size=8", f"model.seq_len={SEQ}")
CASES = {
    "1x1x1": layout(1, 1, 1, microbatches=1),
    "2x2x2-1f1b-m4": layout(2, 2, 2, "1F1B", 4),
    "1x2x4-1f1b-m4": layout(1, 2, 4, "1F1B", 4),
    "4x1x2-1f1b-m2": layout(4, 1, 2, "1F1B", 2),
}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chat")
    make_tokenizer(out / "tok")
    rows = conversations(40)
    rows[5].append({"role": "user", "content": " ".join(["Tell me more about every river and lamp."] * 4)})
    rows[5].append({"role": "assistant", "content": "No."})  # pushes row 5 past the window: cut
    write_chat(out / "chat.parquet", rows)
    return out


def _sets(chat_dir: Path, *extra: str) -> list[str]:
    return [
        *COMMON,
        "data.format=chat",
        f"data.path={chat_dir / 'chat.parquet'}",
        f"data.tokenizer={chat_dir / 'tok'}",
        f"model.vocab_size={VOCAB}",
        "data.shuffle_buffer=0",
        *extra,
    ]


@functools.lru_cache(maxsize=4)
def _reference(chat: str, sets: tuple[str, ...]):
    """(initial state, per-step reference, per-step (tokens, mask)) for ``sets``."""
    cfg = load_config(None, list(sets))
    examples = chat_examples(Path(chat) / "tok", Path(chat) / "chat.parquet", SEQ)
    steps = batches(cfg, examples, pad=make_pad(Path(chat) / "tok"))
    initial = initial_state(cfg)
    return initial, masked_reference_run(cfg, steps, initial), steps


def make_pad(tok_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir)).pad_token_id


def test_chat_rows_encode_as_the_reference_renders_them(chat_dir):
    """The package's encoding (character offsets of each turn) equals the reference's (token
    counts of the conversation rendered up to and through each assistant turn)."""
    import pyarrow.parquet as pq

    from raytrain_hybrid.data.chat import LONG_PROMPT, ExampleSpec, encode_row
    from raytrain_hybrid.data.tokenizer import load_hf_tokenizer

    cfg = load_config(None, _sets(chat_dir))
    spec = ExampleSpec.of(cfg)
    tok = load_hf_tokenizer(spec.tokenizer)
    want = chat_examples(chat_dir / "tok", chat_dir / "chat.parquet", SEQ)
    got = []
    for msgs in pq.read_table(chat_dir / "chat.parquet").column("messages").to_pylist():
        ids, mask, status = encode_row(tok, spec, (msgs,))
        assert status != LONG_PROMPT
        got.append((ids, mask))
    assert [list(i) for i, _ in want] == [i for i, _ in got]
    assert [list(m) for _, m in want] == [m for _, m in got]
    ids, mask = got[0]
    text = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    answer = pq.read_table(chat_dir / "chat.parquet").column("messages")[0].as_py()[-1]["content"]
    assert text == f"{answer}<|im_end|>\n"  # the answer and its turn's end; no header, no prompt


@pytest.fixture(scope="module")
def eight_rank_runs(chat_dir) -> dict[str, dict]:
    """The three 8-rank layouts, one after another in one launch of 8 gloo processes."""
    sets = _sets(chat_dir)
    return run_gloo_jobs(8, {name: [*sets, *overrides] for name, overrides in CASES.items() if name != "1x1x1"})


@pytest.mark.parametrize("name", sorted(CASES))
def test_masked_loss_of_every_layout_matches_single_process(chat_dir, name, request):
    sets = tuple(_sets(chat_dir))
    _, reference, _ = _reference(str(chat_dir), sets)
    if name == "1x1x1":
        result = run_gloo([*sets, *CASES[name]])
    else:
        result = request.getfixturevalue("eight_rank_runs")[name]
    assert_oracle(result, reference)


GPT2_LAYOUT = layout(1, 2, 2, "1F1B", 2)
QWEN2_LAYOUT = layout(2, 1, 2, "1F1B", 2)


@pytest.fixture(scope="module")
def qwen2_checkpoint(chat_dir, tmp_path_factory) -> Path:
    """A Qwen2 checkpoint (q/k/v biases, non-zero) written by save_pretrained, with the chat
    tokenizer and its template in the directory."""
    import shutil

    import torch
    import transformers as tf

    ckpt = tmp_path_factory.mktemp("qwen2") / "qwen2"
    torch.manual_seed(3)
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
    config = tf.Qwen2Config(
        vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **sizes
    )
    model = tf.Qwen2ForCausalLM(config)
    with torch.no_grad():  # non-zero q/k/v biases, as a trained checkpoint has (transformers inits zeros)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(ckpt)
    for f in (chat_dir / "tok").iterdir():
        shutil.copy(f, ckpt / f.name)
    return ckpt


def _qwen2_sets(chat_dir: Path, ckpt: Path) -> list[str]:
    sets = [s for s in _sets(chat_dir) if not s.startswith(("data.tokenizer=", "model.vocab_size="))]
    return [*sets, f"model.pretrained={ckpt}", "train.lr=1e-3"]  # not fine-tuning's 2e-5: steps that move it


@pytest.fixture(scope="module")
def four_rank_runs(chat_dir, qwen2_checkpoint) -> dict[str, dict]:
    """GPT-2 at 1x2x2 and the Qwen2 checkpoint at 2x1x2, in one launch of 4 gloo processes."""
    return run_gloo_jobs(
        4,
        {
            "gpt2": [*_sets(chat_dir, "model.arch=gpt2"), *GPT2_LAYOUT],
            "qwen2": [*_qwen2_sets(chat_dir, qwen2_checkpoint), *QWEN2_LAYOUT],
        },
    )


def test_gpt2_masked_loss_matches_single_process(chat_dir, four_rank_runs):
    """GPT-2 (learned positions, fused attention in the reference) at 1x2x2 1F1B m2."""
    sets = tuple(_sets(chat_dir, "model.arch=gpt2"))
    _, reference, _ = _reference(str(chat_dir), sets)
    assert_oracle(four_rank_runs["gpt2"], reference)


def test_qwen2_checkpoint_masked_loss_matches_transformers_loop(chat_dir, qwen2_checkpoint, four_rank_runs):
    """A Qwen2 checkpoint (q/k/v biases) made with save_pretrained, its tokenizer and chat
    template in the directory: model.pretrained alone gives the architecture, the sizes and the
    tokenizer. At 2x1x2 1F1B m2 the engine trains what a plain loop trains on transformers'
    from_pretrained model."""
    import torch
    import transformers as tf

    ckpt = qwen2_checkpoint
    cfg = load_config(None, _qwen2_sets(chat_dir, ckpt))
    assert (cfg.model.arch, cfg.model.vocab_size, cfg.model.hidden_size) == ("qwen2", VOCAB, 64)
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    start = {n: v.detach().clone() for n, v in hf.state_dict().items()}
    examples = chat_examples(chat_dir / "tok", chat_dir / "chat.parquet", SEQ)
    reference = masked_reference_run(cfg, batches(cfg, examples, pad=make_pad(chat_dir / "tok")), start, model=hf)
    assert_oracle(four_rank_runs["qwen2"], reference)


def test_a_mean_per_micro_batch_would_differ(chat_dir):
    """The layouts above split each global batch into dp x microbatches parts with different
    numbers of assistant tokens: averaging each part's mean (what a loss normalized per
    micro-batch reports and differentiates) is off the global masked mean, in the loss and far
    off in the gradient, so the comparison above would fail for it."""
    cfg = load_config(None, _sets(chat_dir))
    initial, reference, steps = _reference(str(chat_dir), tuple(_sets(chat_dir)))
    tokens, mask = steps[0]
    counts = mask[:, 1:].sum(1)
    assert len(set(counts.tolist())) > 3, counts
    want = reference[0]
    for dp, m in ((2, 4), (1, 4), (4, 2)):
        loss, norm = mean_of_split_means(cfg, tokens, mask, dp, m, initial)
        # At random init every token's loss is near log(vocab), so the loss moves little (3e-4 to
        # 1.3e-3 here); the gradient, which weighs tokens differently, by 10 % and more.
        assert abs(loss - want["loss"]) > RTOL * want["loss"], (dp, m, loss, want["loss"])
        assert abs(norm - want["grad_norm"]) > 100 * RTOL * want["grad_norm"], (dp, m, norm, want["grad_norm"])


def _refusal(chat_dir: Path, tmp_path: Path, rows=None, *extra: str) -> ConfigError:
    from raytrain_hybrid.launch.plan.inputs import prepare_input

    path = chat_dir / "chat.parquet" if rows is None else write_chat(tmp_path / "bad.parquet", rows)
    with pytest.raises(ConfigError) as err:
        prepare_input(load_config(None, [*_sets(chat_dir, *extra), f"data.path={path}"]), say=print)
    return err.value


def test_bad_chat_input_is_refused_before_workers_start(chat_dir, tmp_path):
    good = conversations(12)
    bad_role = [*good[:3], [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}], *good[3:]]
    err = _refusal(chat_dir, tmp_path, bad_role)
    assert err.key == "data.messages_column" and "row 3" in str(err) and "'bot'" in str(err)
    err = _refusal(chat_dir, tmp_path, [*good, [{"role": "user", "content": "Hello?"}]])
    assert err.key == "data.messages_column" and "row 12" in str(err) and "no assistant turn" in str(err)
    long = [{"role": "user", "content": "Tell me about the river " * 20}, {"role": "assistant", "content": "Ok."}]
    err = _refusal(chat_dir, tmp_path, [*good, long, long])
    assert err.key == "model.seq_len" and "2 of 14 rows" in str(err) and "row 12" in str(err)
    assert "data.drop_long_prompts=true" in str(err)
    err = _refusal(chat_dir, tmp_path, None, "data.messages_column=conversation")
    assert err.key == "data.messages_column" and "which has columns id, messages" in str(err)
    err = _refusal(chat_dir, tmp_path, None, "model.vocab_size=4096")
    assert err.key == "model.vocab_size" and "4098" in str(err)
    make_tokenizer(tmp_path / "plain", template=None)
    err = _refusal(chat_dir, tmp_path, None, f"data.tokenizer={tmp_path / 'plain'}")
    assert err.key == "data.format" and "chat template" in str(err)


def test_cut_and_dropped_rows_are_counted_once(chat_dir, tmp_path):
    from raytrain_hybrid.launch.plan.inputs import prepare_input

    long = [{"role": "user", "content": "Tell me about the river " * 20}, {"role": "assistant", "content": "Ok."}]
    rows = [*conversations(16), long]
    path = write_chat(tmp_path / "long.parquet", rows)
    said: list[str] = []
    cfg = load_config(None, [*_sets(chat_dir), f"data.path={path}", "data.drop_long_prompts=true"])
    prepare_input(cfg, say=said.append)
    assert len(said) == 1 and said[0].startswith("warning: data.format=chat: "), said
    assert "1 rows are dropped" in said[0]
    said.clear()
    prepare_input(load_config(None, _sets(chat_dir)), say=said.append)
    assert said == [
        "warning: data.format=chat: 1 of 40 rows are longer than model.seq_len+1=65 tokens and are cut "
        "to it (the loss counts what remains)"
    ]


def test_prompt_completion_counts_the_completion(tmp_path):
    """Every row encodes as TRL's prompt/completion tokenization does (the prompt's own token
    count, then the completion and an EOS counted); the counted text is the completion."""
    import pyarrow.parquet as pq

    from raytrain_hybrid.data.chat import ExampleSpec, encode_row
    from raytrain_hybrid.data.tokenizer import load_hf_tokenizer

    tok_dir = make_tokenizer(tmp_path / "tok")
    path = write_prompt_completion(tmp_path / "pc.parquet", 16)
    sets = [*COMMON, "data.format=prompt_completion", f"data.path={path}", f"data.tokenizer={tok_dir}"]
    spec = ExampleSpec.of(load_config(None, [*sets, f"model.vocab_size={VOCAB}"]))
    tok = load_hf_tokenizer(spec.tokenizer)
    table = pq.read_table(path)
    got = [encode_row(tok, spec, v)[:2] for v in zip(*(table.column(c).to_pylist() for c in spec.columns), strict=True)]
    want = prompt_completion_examples(tok_dir, path, SEQ)
    assert [(list(i), list(m)) for i, m in want] == got
    ids, mask, _ = encode_row(tok, spec, ("Describe the lamp:", " A bright lamp."))
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == " A bright lamp.<|im_end|>"
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if not m]) == "Describe the lamp:"


# ------------------------------------------------------------------ from the CLI, through Ray


CLI_SETS = (
    "data.shuffle_buffer=8",
    "parallelism.dp=2",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "parallelism.microbatches=2",
)


@pytest.fixture(scope="module", autouse=True)
def cli_run(ray_local, chat_dir, tmp_path_factory):
    """The CLI run of test_chat_parquet_from_the_cli_trains_as_the_reference, started before this
    module's other tests and left to run beside them: most of a run's start-up is waiting (Ray
    Train's workers, Ray Data's executor), which the gloo runs fill. -> (Popen, run directory)"""
    out = tmp_path_factory.mktemp("chat_cli") / "run"
    argv = [str(Path(sys.executable).parent / "raytrain-hybrid"), "train"]
    address = ray_local.get_runtime_context().gcs_address
    for s in [*_sets(chat_dir), *CLI_SETS, f"run.output_dir={out}", f"cluster.address={address}"]:
        argv += ["--set", s]
    # The input check encodes the rows in Ray Data's tasks, as for a data set of over 5,000 rows.
    env = {**os.environ, "RAYTRAIN_HYBRID_CHECK_ROWS": "0"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc, out
    finally:
        proc.kill()
        proc.communicate()


def test_chat_parquet_from_the_cli_trains_as_the_reference(cli_run, chat_dir):
    """What a user types: `train --set data.format=chat ...` on a chat Parquet file, on the
    session's Ray (Ray Data encodes the rows, for the input check too), at (2,1,1) with 2
    micro-batches and a shuffle buffer; the one warning (a row cut) on the terminal, the loss,
    gradient norm and counted tokens of each step the reference's."""
    proc, out = cli_run
    cfg = load_config(None, [*_sets(chat_dir), *CLI_SETS])
    examples = chat_examples(chat_dir / "tok", chat_dir / "chat.parquet", SEQ)
    steps = batches(cfg, examples, pad=make_pad(chat_dir / "tok"))
    initial = _reference(str(chat_dir), tuple(_sets(chat_dir)))[0]  # the same model: the layout and data differ
    reference = masked_reference_run(cfg, steps, initial)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    warnings = [ln for ln in stdout.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == 1 and "1 of 40 rows" in warnings[0], stdout
    history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == STEPS
    for got, want, (_, mask) in zip(history, reference, steps, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
        assert got["loss_tokens"] == int(mask[:, 1:].sum())  # the assistant tokens of the global batch


def test_data_format_keys_are_checked():
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(None, ["data.format=jsonl"])
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.format=chat", "data.path=memory"])
    assert err.value.key == "data.format" and "data.path=memory" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.format=prompt_completion", "model.arch=multimodal-bert", "model.pretrained=none"])
    assert err.value.key == "data.format" and "language models" in str(err.value)


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_chat"


def _example_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example_checkpoint(tmp_path_factory) -> Path:
    """The example's checkpoint (make_checkpoint.py): a small Llama with a ChatML tokenizer."""
    out = tmp_path_factory.mktemp("example") / "ckpt"
    _example_module("make_checkpoint").main(out)
    return out


def test_the_example_checkpoint_and_chat_file_pass_the_input_check(example_checkpoint, monkeypatch):
    """examples/finetune_chat: the shipped chat.parquet is what make_data.py writes, and with
    the checkpoint make_checkpoint.py writes, its config passes the input check (the tokenizer
    and chat template from model.pretrained, no row cut)."""
    import pyarrow.parquet as pq

    from raytrain_hybrid.launch.plan.inputs import prepare_input

    monkeypatch.chdir(EXAMPLE.parent.parent)  # the example's paths are the repository root's
    shipped = pq.read_table(EXAMPLE / "chat.parquet").column("messages").to_pylist()
    assert shipped == _example_module("make_data").conversations(400)
    cfg = load_config(EXAMPLE / "finetune.toml", [f"model.pretrained={example_checkpoint}"])
    said: list[str] = []
    cfg = prepare_input(cfg, say=said.append)
    assert said == [] and cfg.model.vocab_size == VOCAB and cfg.data.path.endswith("chat.parquet")


def test_raw_text_is_tokenized_with_the_checkpoints_tokenizer(example_checkpoint, tmp_path):
    """model.pretrained's tokenizer.json for raw text too, each document ended with its
    eos_token; a checkpoint without one is refused, naming data.tokenizer."""
    import shutil

    import pyarrow as pa

    from raytrain_hybrid.data.prepare import tokenize_batch
    from raytrain_hybrid.data.tokenizer import end_of_text, resolve_tokenizer

    cfg = load_config(None, [f"model.pretrained={example_checkpoint}", "data.path=x.parquet", "data.text_column=t"])
    assert resolve_tokenizer(cfg) == str(example_checkpoint / "tokenizer.json")
    assert end_of_text(cfg) == "<|im_end|>"
    table = pa.table({"t": ["What is 2 plus 2?"]})
    ids = tokenize_batch(table, text_column="t", tokenizer=resolve_tokenizer(cfg), eos=end_of_text(cfg))
    assert ids.column("input_ids")[0].as_py()[-1] == 4096  # <|im_end|>, an added token
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(example_checkpoint / name, bare / name)
    with pytest.raises(ConfigError) as err:
        resolve_tokenizer(load_config(None, [f"model.pretrained={bare}", "data.text_column=t"]))
    assert err.value.key == "data.tokenizer" and "has no tokenizer.json" in str(err.value)


def test_the_tokenizer_comes_from_a_checkpoint_on_object_storage(example_checkpoint):
    """model.pretrained=s3://...: the input check and the encoding read the tokenizer files from
    the bucket (TokenizerFiles, the bytes that travel with Ray Data's tasks); no local copy."""
    import pyarrow.parquet as pq
    from s3_server import s3_server

    from raytrain_hybrid.data.chat import ExampleSpec, encode_table
    from raytrain_hybrid.launch.plan.inputs import prepare_input
    from raytrain_hybrid.storage import open_store

    with s3_server():
        open_store("s3://bucket/models/tiny").upload(str(example_checkpoint))
        sets = ["model.pretrained=s3://bucket/models/tiny", "data.format=chat", f"data.path={EXAMPLE / 'chat.parquet'}"]
        cfg = prepare_input(load_config(None, [*sets, "model.seq_len=128"]), say=print)
        spec = ExampleSpec.of(cfg)
    assert spec.tokenizer.source == "s3://bucket/models/tiny"
    assert {n for n, _ in spec.tokenizer.files} >= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    encoded = encode_table(pq.read_table(EXAMPLE / "chat.parquet").slice(0, 4), spec=spec)
    assert encoded.num_rows == 4 and all(sum(m) > 0 for m in encoded.column("label_mask").to_pylist())
