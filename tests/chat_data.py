"""Test inputs for fine-tuning data (data.format): a tokenizer with a chat template and chat /
prompt-completion Parquet files, all made here (no network).

The tokenizer is the shipped BPE (raytrain_hybrid/assets/tokenizer.json) wrapped in
transformers' PreTrainedTokenizerFast with two added special tokens and a ChatML template, saved
with save_pretrained: 4,098 tokens, so model.vocab_size must be raised to cover it (4,104 is a
multiple of 8 for vocab-parallel TP). The conversations' answers have very different lengths, so
micro-batches and replicas hold different numbers of assistant tokens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ASSETS = Path(importlib.util.find_spec("raytrain_hybrid").submodule_search_locations[0]) / "assets"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 4104

_NAMES = ["river", "lamp", "garden", "window", "bridge", "letter", "engine", "forest", "market", "harbor"]
_WORDS = "the a small old bright quiet green heavy of near under across with and slowly".split()


def make_tokenizer(out: Path, template: str | None = CHATML) -> Path:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    return out


def _sentence(rng, words: int) -> str:
    return " ".join(rng.choice(_WORDS + _NAMES, size=words)).capitalize() + "."


def conversations(count: int, seed: int = 0) -> list[list[dict]]:
    """Short conversations (at most 64 tokens): an optional system line, one or two
    user/assistant exchanges, answers of 1 to 10 words (1 to 4 in two exchanges)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        two = i % 4 == 1
        msgs = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 and not two else []
        for _ in range(1 + two):
            msgs.append({"role": "user", "content": f"Tell me about the {rng.choice(_NAMES)}?"})
            msgs.append({"role": "assistant", "content": _sentence(rng, int(rng.integers(1, 5 if two else 11)))})
        out.append(msgs)
    return out


def write_chat(path: Path, rows: list[list[dict]], column: str = "messages") -> Path:
    kind = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    pq.write_table(pa.table({"id": list(range(len(rows))), column: pa.array(rows, type=kind)}), path)
    return path


def write_prompt_completion(path: Path, count: int, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    prompts = [f"Describe the {rng.choice(_NAMES)}:" for _ in range(count)]
    completions = [" " + _sentence(rng, int(rng.integers(1, 13))) for _ in range(count)]
    pq.write_table(pa.table({"prompt": prompts, "completion": completions}), path)
    return path
