"""Which tokenizer a run uses, and the cached loaders every data path shares.

Language models tokenize text with ``data.tokenizer`` (a tokenizer.json, or a Hugging Face
tokenizer directory), else with their checkpoint's (``model.pretrained``), else with the shipped
BPE; classifiers with ``data.tokenizer``, else their checkpoint's (with random weights, the
packaged MiniLM's). A directory's tokenizer is loaded with transformers (its special tokens and
chat template come with it); raw text is tokenized with its tokenizer.json alone, each document
ended with the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # raytrain_hybrid/assets
DEFAULT_CORPUS = ASSETS / "corpus.txt"  # the shipped corpus (data.path="builtin")
DEFAULT_TOKENIZER = ASSETS / "tokenizer.json"
EOT = "<|endoftext|>"


def tokenizer_json(path: str | Path = "") -> str:
    """``path`` (default: the shipped BPE; a directory: its tokenizer.json) as an absolute path:
    Ray Data's tasks run elsewhere."""
    path = Path(path or DEFAULT_TOKENIZER).expanduser()
    return str((path / "tokenizer.json" if path.is_dir() else path).resolve())


def tokenizer_source(cfg) -> str:
    """A language model's tokenizer: data.tokenizer (a file or directory), else model.pretrained
    (a checkpoint directory, local or a storage URI; a Hub id's files but its weights, fetched
    into this machine's Hugging Face cache), else "" (the shipped BPE)."""
    if cfg.data.tokenizer:
        return _absolute(cfg.data.tokenizer)
    pretrained = cfg.model.pretrained
    if pretrained and pretrained.lower() != "none" and not cfg.data.text_columns:
        from raytrain_hybrid.models import hub

        if hub.is_hub_id(pretrained):
            return str(hub.snapshot(pretrained, cfg.model.pretrained_revision, weights=False))
        return _absolute(pretrained)
    return ""


def _absolute(location: str) -> str:
    return location if "://" in location else str(Path(location).expanduser().resolve())


def resolve_tokenizer(cfg) -> str:
    """A language model's tokenizer.json (the one raw text goes through), on this machine."""
    source = tokenizer_source(cfg)
    if source and not cfg.data.tokenizer and not (Path(source) / "tokenizer.json").is_file():
        from raytrain_hybrid.errors import ConfigError

        where = "is a storage URI" if "://" in source else "has no tokenizer.json"
        raise ConfigError(
            "data.tokenizer",
            "",
            f"raw text is tokenized with model.pretrained's tokenizer, and {source} {where}; give data.tokenizer "
            "a local tokenizer.json (or a directory with one)",
        )
    return tokenizer_json(source)


def end_of_text(cfg) -> str:
    """The token that ends each raw-text document: a tokenizer directory's eos_token, else EOT."""
    source = tokenizer_source(cfg)
    return eos_token(source) if source and Path(source).is_dir() else EOT


def eos_token(directory: str | Path) -> str:
    """tokenizer_config.json's eos_token (a string or {"content": ...}); EOT when it has none."""
    import json

    file = Path(directory) / "tokenizer_config.json"
    conf = json.loads(file.read_text()) if file.is_file() else {}
    eos = conf.get("eos_token") or EOT
    return eos["content"] if isinstance(eos, dict) else eos


def classifier_tokenizer(cfg) -> str:
    """A classifier's tokenizer.json: data.tokenizer, else the checkpoint's (or the packaged MiniLM's)."""
    from raytrain_hybrid.models.pretrained import tokenizer_file

    if cfg.data.tokenizer:
        return tokenizer_json(cfg.data.tokenizer)
    pretrained = cfg.model.pretrained if cfg.model.pretrained.lower() != "none" else ""
    return str(tokenizer_file(pretrained))


def load_tokenizer(path: str | Path = "", fixed_length: int = 0):
    """The tokenizer at ``path`` (default: the shipped BPE), loaded once per process.

    ``fixed_length``: every encoding is truncated or padded to that many ids (with a 0/1
    attention mask). That is a separate cached instance, so the setting never reaches a
    caller that wants plain encodings.
    """
    return _load(tokenizer_json(path), fixed_length)


def _one_thread_each() -> None:
    """Tokenizers' own thread pool off in this process (a user's setting wins): every Ray Train
    worker and Ray Data task tokenizes on its own core. Set here, where tokenizers are loaded,
    and not as a runtime env for the run's workers: a worker with a runtime env starts through
    a second Python process (~0.5 s of CPU each, for every worker and task of a run)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@functools.lru_cache(maxsize=8)
def _load(path: str, fixed_length: int):
    from tokenizers import Tokenizer

    _one_thread_each()

    if not Path(path).is_file():
        raise FileNotFoundError(f"data.tokenizer={path!r} does not exist; give a local tokenizer.json")
    tok = Tokenizer.from_file(path)
    if fixed_length:
        pad = tok.token_to_id("[PAD]")
        tok.enable_truncation(max_length=fixed_length)
        tok.enable_padding(length=fixed_length, pad_id=0 if pad is None else pad)
    return tok


# The files a transformers tokenizer is made of; a directory's are carried where they exist.
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer's files as bytes, read once where the run starts (a local directory or file,
    or a storage URI) and rebuilt wherever a Ray Data task or a worker runs: no node needs them
    on its own disk."""

    source: str
    files: tuple[tuple[str, bytes], ...]
    digest: str

    @classmethod
    def read(cls, source: str) -> TokenizerFiles:
        from raytrain_hybrid.storage import open_store

        store = open_store(source or str(DEFAULT_TOKENIZER), "data.tokenizer")
        if store.is_dir():
            files = tuple((n, store.child(n).read_bytes()) for n in HF_FILES if store.child(n).is_file())
        elif store.is_file():
            files = (("tokenizer.json", store.read_bytes()),)
        else:
            raise FileNotFoundError(f"{store.uri} does not exist")
        if not any(n == "tokenizer.json" for n, _ in files):
            raise FileNotFoundError(f"{store.uri} has no tokenizer.json (a slow, sentencepiece-only tokenizer)")
        digest = hashlib.sha256(b"".join(n.encode() + b"\0" + data for n, data in files)).hexdigest()[:16]
        return cls(store.uri, files, digest)


_HF_LOADED: dict[str, object] = {}


def load_hf_tokenizer(bundle: TokenizerFiles):
    """The transformers tokenizer of ``bundle``, once per process: a directory's with its special
    tokens and chat template (AutoTokenizer), or a lone tokenizer.json (the shipped BPE) wrapped
    with EOT as its end-of-sequence token."""
    if bundle.digest not in _HF_LOADED:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        from raytrain_hybrid.storage import private_dir

        _one_thread_each()

        # This user's own directory: files planted under a shared /tmp name would be loaded.
        where = private_dir("tokenizers") / bundle.digest
        if not where.is_dir():
            part = where.with_name(f"{where.name}.{os.getpid()}")
            part.mkdir(parents=True, exist_ok=True)
            for name, data in bundle.files:
                (part / name).write_bytes(data)
            part.rename(where) if not where.exists() else shutil.rmtree(part)
        if (where / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        else:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(where / "tokenizer.json"))
            if tok.convert_tokens_to_ids(EOT) is not None:
                tok.eos_token = EOT
        _HF_LOADED[bundle.digest] = tok
    return _HF_LOADED[bundle.digest]
