"""Pretrained Hugging Face language models (model.pretrained) in any layout.

The checkpoints are made here with transformers' own ``save_pretrained`` (random weights from a
fixed seed, 4 layers, width 64): Llama (untied head, written as two safetensors files with an
index), GPT-2 (tied embeddings, Conv1D weights, fused q/k/v) and Qwen2 (q/k/v biases, linear
RoPE scaling), each with a tokenizer that has a chat template. No network.

- logits: the engine, loaded at (1,1,1), (2,2,2) ZeRO-3, (1,2,4) and (4,1,2) ZeRO-1 as plain
  gloo processes (every architecture and 8-rank layout in one launch), gives the logits of
  ``AutoModelForCausalLM.from_pretrained(dir)`` on the same batch (fp32, 1e-5 of their scale);
- training from the checkpoint at (2,2,2) is the single-process reference's training (the
  reference starts from the weights transformers loads, not from ours), then ``export`` writes
  a directory whose ``from_pretrained`` logits are the trained model's, with the tokenizer,
  chat template and generation config, so ``pipeline("text-generation")`` runs on it;
- refusals name the key: no config.json, no weights, no spec for the model_type, sizes or
  architecture that disagree with the checkpoint, a sequence longer than it attends over
  (the CLI's exit code 2 for a ConfigError is tests/test_config.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

VOCAB, SEQ, ROWS = 4096, 32, 8  # the shipped tokenizer's 4096 ids
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LAYOUTS = {  # (dp, tp, pp) with the ZeRO stage, schedule and micro-batches each runs
    "1x1x1": ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"],
    "2x2x2-zero3": ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.zero=3"],
    "1x2x4-gpipe": ["parallelism.dp=1", "parallelism.tp=2", "parallelism.pp=4", "parallelism.schedule=GPipe"],
    "4x1x2-zero1": ["parallelism.dp=4", "parallelism.tp=1", "parallelism.pp=2", "parallelism.zero=1"],
}
MICRO = {"1x1x1": 1, "2x2x2-zero3": 2, "1x2x4-gpipe": 4, "4x1x2-zero1": 2}


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    from raytrain_hybrid.data.tokenizer import DEFAULT_TOKENIZER

    eot = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_file=str(DEFAULT_TOKENIZER), eos_token=eot, bos_token=eot, pad_token=eot, chat_template=CHAT_TEMPLATE
    )


def make_checkpoint(root: Path, arch: str) -> Path:
    """A tiny checkpoint of ``arch`` written by transformers, with a chat tokenizer."""
    import transformers as tf

    torch.manual_seed({"llama": 1, "gpt2": 2, "qwen2": 3}[arch])
    common = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.1}
    if arch == "gpt2":  # tied by default
        config = tf.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=128, **common)
        model = tf.GPT2LMHeadModel(config)
    else:
        family = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
        family |= {"num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}
        if arch == "llama":  # LlamaConfig's other defaults: what tests/reference.py builds
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**family, **common))
        else:
            rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**family, **common, rope_parameters=rope))
    out = root / arch
    # Llama as two safetensors files and an index, the others as one model.safetensors.
    model.save_pretrained(out, max_shard_size="2MB" if arch == "llama" else "50MB")
    _tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {arch: make_checkpoint(root, arch) for arch in ("llama", "gpt2", "qwen2")}
    shards = sorted(p.name for p in dirs["llama"].glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shards
    assert (dirs["llama"] / "model.safetensors.index.json").is_file()
    assert [p.name for p in dirs["gpt2"].glob("*.safetensors")] == ["model.safetensors"]
    return dirs


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))


def _hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _close(got, want, rtol: float = 1e-5) -> float:
    """The largest difference as a fraction of the logits' scale."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ------------------------------------------------------------------ logits under every layout


def _logits(rank: int, world: int, jobs: dict) -> dict:
    """One gloo rank (gloo_harness.launch_ranks): build each job's model from its checkpoint,
    run the replica's rows forward, gather the last stage's logits (one TP rank per replica)
    to rank 0."""
    import torch.distributed as dist

    from raytrain_hybrid.data.corpus import Batch
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
    from raytrain_hybrid.engine.trainer import Trainer

    out: dict = {}
    ids = _batch()
    for name, overrides in jobs.items():
        cfg = load_config(None, overrides)
        dims = ParallelDims.from_config(cfg.parallelism)
        trainer = Trainer(cfg, dims, dims.build_mesh("cpu", arrange_ranks(dims, ["n"] * world)), torch.device("cpu"))
        rows = ids.chunk(dims.dp)[trainer.dp_rank]
        logits = trainer.predict(Batch(inputs=(rows,), labels=rows))
        mine = None
        if logits is not None and trainer.mesh.tp.get_local_rank() == 0:
            mine = (trainer.dp_rank, logits.numpy())
        parts = [None] * world if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if rank == 0:
            got = dict(p for p in parts if p is not None)
            out[name] = np.concatenate([got[r] for r in range(dims.dp)])
    return out


def _launch_logits(world: int, jobs: dict, env: dict | None = None) -> dict:
    from gloo_harness import launch_ranks

    return launch_ranks(_logits, world, jobs, env=env)  # env: the S3 endpoint, in each rank


@pytest.fixture(scope="module")
def s3_qwen2(checkpoints):
    """The Qwen2 checkpoint in a bucket of the loopback S3 server."""
    from s3_server import s3_server

    from raytrain_hybrid.storage import open_store

    with s3_server() as env:
        open_store("s3://bucket/models/qwen2").upload(str(checkpoints["qwen2"]))
        yield "s3://bucket/models/qwen2", env


@pytest.mark.parametrize("world", [1, 8])
def test_sharded_logits_equal_transformers_from_pretrained(checkpoints, world, request):
    """Each rank reads only its slices (TP, PP stage, FSDP/ZeRO shard) straight from the
    safetensors files; the assembled logits are transformers' own. The 8-rank layouts run in
    one launch; at (2,2,2) the Qwen2 checkpoint is read from S3 too (each rank its byte ranges,
    straight from the bucket: no copy on the node)."""
    sources = dict(checkpoints)
    env = {}
    if world == 8:
        sources["qwen2-s3"], env = request.getfixturevalue("s3_qwen2")
    jobs = {}
    for layout, overrides in LAYOUTS.items():
        common = [
            f"model.seq_len={SEQ}",
            f"train.global_batch_size={ROWS}",
            f"parallelism.microbatches={MICRO[layout]}",
        ]
        if (
            load_config(None, [f"model.pretrained={checkpoints['llama']}", *common, *overrides]).parallelism.world_size
            != world
        ):
            continue
        for name, where in sources.items():
            if name.endswith("-s3") and layout != "2x2x2-zero3":
                continue
            jobs[f"{name} at {layout}"] = [f"model.pretrained={where}", *common, *overrides]
    got = _launch_logits(world, jobs, env)
    ids = _batch()
    want = {name: _hf_logits(path, ids) for name, path in checkpoints.items()}
    for job in jobs:
        err = _close(got[job], want[job.split(" ")[0].removesuffix("-s3")])
        assert err <= 1e-5, f"{job}: logits differ by {err:.2e} of their scale"
    assert len(jobs) == (3 if world == 1 else 10), sorted(jobs)
    if env:  # (that nothing is staged on the node: tests/test_pretrained_range.py)
        with pytest.raises(ConfigError, match="has no config.json"):
            load_config(None, ["model.pretrained=s3://bucket/models/nothing"])


# ------------------------------------------------------------------ fine-tune, export, generate


def test_finetune_matches_reference_and_export_generates(checkpoints, tmp_path):
    from conftest import reference_history  # noqa: F401 - the session's reference cache lives there
    from gloo_harness import run_gloo
    from reference import reference_run
    from test_oracle import assert_oracle
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    src = checkpoints["llama"]
    out = tmp_path / "run"
    overrides = [
        f"model.pretrained={src}",
        "data.path=memory",
        f"model.seq_len={SEQ}",
        "train.steps=3",
        "train.global_batch_size=8",
        "train.lr=1e-3",  # large enough that 3 steps move the logits visibly
        *LAYOUTS["2x2x2-zero3"],
        "parallelism.microbatches=2",
        "checkpoint.interval=3",
        f"run.output_dir={out}",
    ]
    result = run_gloo(overrides)
    cfg = load_config(None, overrides)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
    start = {n: v.detach().clone() for n, v in hf.state_dict().items()}  # transformers' load, not ours
    assert_oracle(result, reference_run(cfg, initial=start))

    exported = tmp_path / "hf"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "raytrain-hybrid"), "export", str(out), str(exported)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names, names
    assert json.loads((exported / "generation_config.json").read_text()) == json.loads(
        (src / "generation_config.json").read_text()
    )
    # The trained parameters (the engine's, gathered) in transformers' model of the checkpoint.
    trained = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True).eval()
    trained.load_state_dict({n: torch.as_tensor(v) for n, v in result["probe"]["final"].items()}, strict=True)
    ids = _batch()
    with torch.no_grad():
        want = trained(input_ids=ids).logits
    got = _hf_logits(exported, ids)
    assert _close(got, want) <= 1e-5
    assert _close(got, _hf_logits(src, ids)) > 1e-3  # training moved them

    assert AutoTokenizer.from_pretrained(exported).chat_template == CHAT_TEMPLATE
    generate = pipeline("text-generation", model=str(exported), device="cpu")
    text = generate("The ship", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert text.startswith("The ship") and len(text) > len("The ship")


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_export_after_finetuning_gives_the_trained_logits(checkpoints, tmp_path, arch):
    """GPT-2 (tied in the checkpoint: exported untied, as trained) and Qwen2 (biases, RoPE
    scaling): two steps at (1,1,2), export, and from_pretrained's logits are those of the
    checkpoint's own transformers config (untied) holding the engine's trained parameters."""
    from gloo_harness import run_gloo
    from reference import gpt2_from_engine
    from transformers import AutoConfig, AutoModelForCausalLM

    src, out = checkpoints[arch], tmp_path / "run"
    result = run_gloo(
        [f"model.pretrained={src}", "data.path=memory", f"model.seq_len={SEQ}", "train.steps=2", "train.lr=1e-3",
         "train.global_batch_size=4", "parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2",
         "parallelism.microbatches=2", "checkpoint.interval=2", f"run.output_dir={out}"]
    )  # fmt: skip
    exported = tmp_path / "hf"
    cli = str(Path(sys.executable).parent / "raytrain-hybrid")
    done = subprocess.run([cli, "export", str(out), str(exported)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    final = {n: torch.as_tensor(v) for n, v in result["probe"]["final"].items()}
    config = AutoConfig.from_pretrained(src, tie_word_embeddings=False)
    trained = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = trained.load_state_dict(gpt2_from_engine(final) if arch == "gpt2" else final, strict=False)
    assert not unexpected and not set(missing) & set(dict(trained.named_parameters())), (missing, unexpected)
    ids = _batch()
    with torch.no_grad():
        want = trained(input_ids=ids).logits
    got = _hf_logits(exported, ids)
    assert _close(got, want) <= 1e-5
    assert _close(got, _hf_logits(src, ids)) > 1e-3  # training moved them
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is False


# ------------------------------------------------------------------ refusals, resolution


def test_architecture_and_sizes_come_from_the_checkpoint(checkpoints):
    cfg = load_config(None, [f"model.pretrained={checkpoints['gpt2']}", "parallelism.tp=2"])
    m = cfg.model
    assert (m.arch, m.num_layers, m.hidden_size, m.num_heads, m.vocab_size) == ("gpt2", 4, 64, 4, VOCAB)
    assert m.ffn_hidden_size == 256 and cfg.train.lr == 2e-5  # GPT-2's 4x MLP; fine-tuning's rate
    q = load_config(None, [f"model.pretrained={checkpoints['qwen2']}", "model.num_layers=4", "model.arch=qwen2"])
    assert (q.model.arch, q.model.num_kv_heads, q.model.ffn_hidden_size) == ("qwen2", 2, 128)
    assert load_config(None, [f"model.pretrained={checkpoints['qwen2']}"]) == q  # resolving again: the same
    assert load_config(None, ["model.pretrained=none"]).model.num_layers == 4  # random weights as before


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        (["model.num_layers=3"], "model.num_layers", ["3", "whose value is 4"]),
        (["model.arch=gpt2"], "model.arch", ["gpt2", "whose value is 'llama'"]),
        (["model.hidden_size=96"], "model.hidden_size", ["96", "whose value is 64"]),
        (["model.hidden_size=128"], "model.hidden_size", ["128", "whose value is 64"]),  # 128: the default
        (["model.seq_len=256"], "model.seq_len", ["256", "(128)"]),
    ],
)
def test_disagreeing_keys_are_refused(checkpoints, extra, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.pretrained={checkpoints['llama']}", *extra])
    assert info.value.key == key
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_directories_are_refused(checkpoints, tmp_path):
    from raytrain_hybrid.checkpoint.hf_load import fetch_pretrained

    with pytest.raises(ConfigError, match="has no config.json") as info:
        load_config(None, [f"model.pretrained={tmp_path / 'missing'}"])
    assert info.value.key == "model.pretrained"
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        ConfigError, match=r"is a BERT checkpoint, which is for the classifier: model.arch=multimodal-bert"
    ):
        load_config(None, [f"model.pretrained={bert}"])
    encdec = tmp_path / "t5"  # a transformers model_type that is no decoder: refused saying so
    encdec.mkdir()
    (encdec / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match=r"model_type 't5' is not a causal language model"):
        load_config(None, [f"model.pretrained={encdec}"])
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    (bare / "pytorch_model.bin").write_bytes(b"")
    load_config(None, [f"model.pretrained={bare}"])  # config and planner need only config.json
    with pytest.raises(ConfigError, match=r"has no \*\.safetensors weights .*pytorch_model\.bin") as info:
        fetch_pretrained(str(bare))  # the load (and the driver before workers start) refuses it
    assert info.value.key == "model.pretrained"


def test_mistral_resolves_and_its_positions_bound_seq_len(tmp_path):
    """A Mistral checkpoint trains on the generic path, which masks each layer's sliding window
    (held shorter than the rows for the families of tests/test_models.py): a seq_len past the window
    is taken, one past max_position_embeddings refused naming it."""
    from transformers import MistralConfig

    path = tmp_path / "mistral"
    conf = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=48, max_position_embeddings=256,
    )  # fmt: skip
    conf.save_pretrained(path)
    cfg = load_config(None, [f"model.pretrained={path}", "model.seq_len=64"])
    assert (cfg.model.arch, cfg.model.num_kv_heads, cfg.model.seq_len) == ("mistral", 2, 64)
    with pytest.raises(ConfigError, match=r"\(256\)") as info:
        load_config(None, [f"model.pretrained={path}", "model.seq_len=512"])
    assert info.value.key == "model.seq_len"


def test_a_mixture_of_experts_window_bounds_seq_len_only_where_its_family_slides():
    """The MoE specs' context length: Mixtral slides whenever sliding_window is set; Qwen3-MoE only
    with use_sliding_window, whose absence is off (transformers' default), as a config.json may leave it."""
    from raytrain_hybrid.models.llama import max_seq_len

    qwen3_moe = {"model_type": "qwen3_moe", "sliding_window": 4096, "max_position_embeddings": 40960}
    assert max_seq_len(qwen3_moe) == 40960
    assert max_seq_len({**qwen3_moe, "use_sliding_window": True}) == 4096
    assert max_seq_len({"model_type": "mixtral", "sliding_window": 4096, "max_position_embeddings": 32768}) == 4096
