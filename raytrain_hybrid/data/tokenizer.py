"""Which tokenizer.json a run uses, and the one cached loader every data path shares.

Language models tokenize text with ``data.tokenizer`` (default: the shipped BPE); classifiers
with ``data.tokenizer``, else their checkpoint's (with random weights, the packaged MiniLM's).
"""

from __future__ import annotations

import functools
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"  # raytrain_hybrid/assets
DEFAULT_TOKENIZER = ASSETS / "tokenizer.json"
EOT = "<|endoftext|>"


def tokenizer_json(path: str | Path = "") -> str:
    """``path`` (default: the shipped BPE) as an absolute path: Ray Data's tasks run elsewhere."""
    return str(Path(path or DEFAULT_TOKENIZER).resolve())


def resolve_tokenizer(cfg) -> str:
    """A language model's tokenizer.json."""
    return tokenizer_json(cfg.data.tokenizer)


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


@functools.lru_cache(maxsize=8)
def _load(path: str, fixed_length: int):
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise FileNotFoundError(f"data.tokenizer={path!r} does not exist; give a local tokenizer.json")
    tok = Tokenizer.from_file(path)
    if fixed_length:
        pad = tok.token_to_id("[PAD]")
        tok.enable_truncation(max_length=fixed_length)
        tok.enable_padding(length=fixed_length, pad_id=0 if pad is None else pad)
    return tok
