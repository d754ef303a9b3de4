"""Hugging Face Hub ids as model.pretrained, and `check` without a network or credentials.

No network here: a Hugging Face cache is filled in a temporary HF_HOME the way huggingface_hub
fills it (hub/models--ORG--NAME/snapshots/<commit>/ and refs/main holding <commit>) with the
tiny Llama test_pretrained.py writes with transformers (two safetensors shards, a tokenizer
with a chat template), and HF_HUB_OFFLINE=1 makes huggingface_hub resolve from it alone.
HF_TOKEN holds a sentinel that must not reach anything the trainer writes.

- `check --set model.pretrained=ORG/NAME` resolves the model keys from the cached config.json
  (a size that disagrees is refused by the CLI with exit 2); the resolved config pins the
  commit; the engine loads, through the Hub id, the checkpoint's own tensors;
- an id the cache does not hold, or a revision it does not hold, is refused with what to do
  (`train`: exit 2), while `check` says what it could not verify and validates the rest;
- the fine-tuning job's `check` works with no network and no cloud credentials, and its
  `train` still needs the checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "raytrain-hybrid")
REPO = "tiny-org/tiny-llama"
COMMIT = hashlib.sha1(b"tiny-llama").hexdigest()
SENTINEL = "hf_sentinel_never_written_4b1d"
TINY = ["model.seq_len=32", "train.global_batch_size=4", "parallelism.microbatches=1"]
TINY += ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1"]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """(HF_HOME holding REPO at COMMIT as refs/main, the same checkpoint as a plain directory)."""
    from test_pretrained import make_checkpoint

    root = tmp_path_factory.mktemp("hub")
    src = make_checkpoint(root / "src", "llama")
    repo = root / "home" / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(src, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "home", src


def _env(home: Path) -> dict:
    """A user's shell with the filled cache, offline, a token, and no cloud credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_", "GOOGLE_"))}
    return env | {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_TOKEN": SENTINEL}


def _offline(home: Path) -> None:
    """This process as one started with _env (huggingface_hub reads its environment at import)."""
    from huggingface_hub import constants

    from raytrain_hybrid.models import hub

    os.environ.update({k: v for k, v in _env(home).items() if k.startswith("HF_")})
    constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = True, str(home / "hub")
    hub.snapshot.cache_clear()


@pytest.fixture
def offline(hf_home, monkeypatch):
    from huggingface_hub import constants

    for key in ("HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(key, raising=False)  # restored after the test
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", constants.HF_HUB_CACHE)
    _offline(hf_home[0])
    yield hf_home
    from raytrain_hybrid.models import hub

    hub.snapshot.cache_clear()


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, env=_env(home), cwd=ROOT, timeout=120)


def test_a_hub_id_resolves_from_the_cache_offline(offline):
    home, src = offline
    cfg = load_config(None, [f"model.pretrained={REPO}", *TINY])
    m = cfg.model
    assert (m.arch, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (
        "llama", 4, 64, 4, 2, 128,
    )  # fmt: skip
    assert (m.pretrained, m.pretrained_revision) == (REPO, COMMIT)  # the commit pinned, the id kept
    assert load_config(None, [f"model.pretrained={REPO}", f"model.pretrained_revision={COMMIT}", *TINY]) == cfg
    assert load_config(None, [f"model.pretrained={REPO}", "model.pretrained_revision=main", *TINY]) == cfg
    assert SENTINEL not in json.dumps(cfg.to_dict())
    # The tokenizer (and chat template) come from the cached snapshot, without the weights.
    from raytrain_hybrid.data.tokenizer import TokenizerFiles, tokenizer_source

    where = Path(tokenizer_source(cfg))
    assert where == home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert {n for n, _ in TokenizerFiles.read(str(where)).files} == {
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
    }  # fmt: skip

    # The CLI, as a user runs it: the checkpoint's 4 layers refuse a --set of 3 (exit 2).
    done = _cli(home, "check", "--set", f"model.pretrained={REPO}", "--set", "model.num_layers=3")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"disagrees with the checkpoint {REPO}, whose value is 4" in done.stderr, done.stderr


def test_a_quantized_hub_release_is_refused_naming_its_method(offline):
    """The same checkpoint published as an FP8 release (config.json's quantization_config): refused
    as quantized, through the Hub id as through a directory (tests/test_check_refusals.py)."""
    home, src = offline
    commit = hashlib.sha1(b"tiny-llama-fp8").hexdigest()
    repo = home / "hub" / "models--tiny-org--tiny-llama-FP8"
    shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    config = repo / "snapshots" / commit / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match=r"tiny-org/tiny-llama-FP8'?: is a quantized checkpoint .*quant_method='fp8'"):
        load_config(None, ["model.pretrained=tiny-org/tiny-llama-FP8", *TINY])


def test_a_lora_repository_is_refused_naming_its_base_model(offline):
    """A PEFT adapter published on the Hub (adapter_config.json, no config.json), in the cache: refused
    as an adapter, naming the base model to give, not as an id the cache does not hold."""
    home, _ = offline
    commit = hashlib.sha1(b"tiny-lora").hexdigest()
    repo = home / "hub" / "models--tiny-org--tiny-lora"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    adapter = {"peft_type": "LORA", "base_model_name_or_path": REPO, "r": 4}
    (repo / "snapshots" / commit / "adapter_config.json").write_text(json.dumps(adapter))
    with pytest.raises(ConfigError, match=rf"is a PEFT adapter .*give model.pretrained='{REPO}' as the checkpoint"):
        load_config(None, ["model.pretrained=tiny-org/tiny-lora", *TINY])


def test_a_lora_repository_the_hub_answers_for_is_refused_naming_its_base_model(monkeypatch, tmp_path):
    """Online: the Hub says the repository has no config.json (404) and hands its adapter_config.json."""
    from unittest import mock

    import huggingface_hub
    from huggingface_hub import errors

    from raytrain_hybrid.models import hub

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-0.6B"}))
    asked = []

    def download(repo_id, filename, revision=None, local_files_only=False, **kwargs):
        asked.append((filename, local_files_only))
        if filename == "adapter_config.json" and not local_files_only:
            return str(tmp_path / "adapter_config.json")
        if local_files_only:
            raise errors.LocalEntryNotFoundError(f"{filename} not cached")
        raise errors.RemoteEntryNotFoundError(f"404 {filename}", response=mock.MagicMock(status_code=404, headers={}))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(
        ConfigError, match=r"someone/qwen3-lora'?: is a PEFT adapter .*model.pretrained='Qwen/Qwen3-0.6B'"
    ):
        hub.config_json("someone/qwen3-lora")
    assert asked == [("config.json", False), ("adapter_config.json", True), ("adapter_config.json", False)]


def test_ids_and_revisions_not_in_the_cache_are_refused(offline, tmp_path):
    home, src = offline
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.pretrained=nobody/nothing"])
    assert info.value.key == "model.pretrained"
    assert "HF_HUB_OFFLINE is set" in str(info.value) and "hf download nobody/nothing" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.pretrained={REPO}", "model.pretrained_revision=v2"])
    assert "revision 'v2' is not in the Hugging Face cache" in str(info.value), str(info.value)
    assert "the cache holds main, commit " + COMMIT[:12] in str(info.value)
    with pytest.raises(ConfigError) as info:  # a revision pins a Hub repository, not a directory
        load_config(None, [f"model.pretrained={src}", "model.pretrained_revision=main"])
    assert info.value.key == "model.pretrained_revision"
    with pytest.raises(ConfigError, match="multimodal-bert takes a local checkpoint directory"):
        load_config(None, ["model.arch=multimodal-bert", f"model.pretrained={REPO}"])
    notes: list[str] = []  # check's way: noted, the rest validated
    cfg = load_config(None, ["model.pretrained=nobody/nothing"], unverified=notes)
    assert cfg.model.pretrained == "nobody/nothing" and len(notes) == 1 and "nobody/nothing" in notes[0]

    train = _cli(home, "train", "--set", "model.pretrained=nobody/nothing", "--set", f"run.output_dir={tmp_path}")
    assert train.returncode == 2, train.stdout + train.stderr
    assert "error: model.pretrained='nobody/nothing'" in train.stderr and "HF_HUB_OFFLINE" in train.stderr
    assert not list(tmp_path.iterdir())  # refused before anything started


def _jobs_offline(rank: int, world: int, home: str, jobs: dict) -> dict:
    """gloo_harness._run_jobs in a rank with _env's Hugging Face settings."""
    from gloo_harness import _run_jobs

    _offline(Path(home))
    return _run_jobs(rank, world, jobs)


def test_engine_loads_the_same_weights_through_the_hub_id(hf_home, tmp_path):
    """A training step from the Hub id in a gloo rank: the engine's initial parameters are the
    checkpoint's tensors (read here from its safetensors files); nothing the run writes holds
    the token, and its saved config pins the commit."""
    from gloo_harness import launch_ranks
    from safetensors.numpy import load_file

    home, src = hf_home
    out = tmp_path / "run"
    job = [f"model.pretrained={REPO}", *TINY, "data.path=memory", "train.steps=1", "checkpoint.interval=1"]
    got = launch_ranks(_jobs_offline, 1, str(home), {"hub": [*job, f"run.output_dir={out}"]})["hub"]
    want = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert got["probe"]["initial"].keys() == want.keys()
    for name, value in want.items():
        assert (got["probe"]["initial"][name] == value).all(), name
    assert len(got["history"]) == 1
    written = [p for p in out.rglob("*") if p.is_file()]
    assert written and not [p for p in written if SENTINEL.encode() in p.read_bytes()]
    assert any(COMMIT.encode() in p.read_bytes() for p in written)  # the saved config pins the commit


def test_the_finetune_jobs_check_works_without_network_or_credentials(tmp_path):
    """The job with its bucket filled in (its header's submit line) names a checkpoint this machine
    cannot reach (no network, no credentials): `check` says so and validates the rest within
    seconds (a region set spares the bucket's region look-up, a few seconds more without a
    network); `train` refuses with the same reason, before anything starts."""
    job = "jobs/finetune_llama3_8b_chat.toml"
    bucket = "s3://example-bucket"  # a user's bucket, filled in as the job's submit line asks
    sets = [f"model.pretrained={bucket}/models/Meta-Llama-3-8B-Instruct", f"data.path={bucket}/chat/train/"]
    sets = [arg for kv in [*sets, f"run.output_dir={bucket}/runs/chat"] for arg in ("--set", kv)]
    env = _env(tmp_path / "hf") | {"AWS_REGION": "us-east-1"}  # an empty Hugging Face home; no AWS keys
    run = functools.partial(subprocess.run, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    check = run([CLI, "check", job, "--hardware", "h100", *sets])
    assert check.returncode == 0, check.stdout + check.stderr
    lines = check.stdout.splitlines()
    assert lines[0].startswith("not verified: model.pretrained='s3://") and "could not be read here" in lines[0]
    assert "layout ok: dp=8 tp=1 pp=1" in check.stdout
    # The planner's prediction on the sizes the job file gives (Meta-Llama-3-8B's), said as theirs.
    assert lines[-1].startswith("planner: H100-80GB SXM, 8 ranks") and "(fits)" in lines[-1], lines[-1]
    assert lines[-1].endswith("(the model sizes the config file gives)"), lines[-1]
    train = run([CLI, "train", job, *sets])
    assert train.returncode == 2 and "error: model.pretrained='s3://" in train.stderr, train.stderr
