"""Regenerate the small text corpus and BPE tokenizer that ship in raytrain_hybrid/assets.

The corpus is English prose taken from the docstrings of Python standard-library
modules (PSF licence), so it exists offline on every machine that has Python.
The committed files are the source of truth; this script documents how they were made:

    .venv/bin/python scripts/make_corpus.py
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "heapq",
    "html",
    "http.client",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "multiprocessing",
    "numbers",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "selectors",
    "shelve",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tkinter",
    "turtle",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
    "zoneinfo",
]
ASSETS = Path(__file__).resolve().parent.parent / "raytrain_hybrid" / "assets"
VOCAB_SIZE = 4096


def docstrings(module_name: str) -> list[str]:
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return []
    out = [inspect.getdoc(mod) or ""]
    for _, obj in sorted(vars(mod).items()):
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for _, meth in sorted(vars(obj).items()):
                    if inspect.isfunction(meth):
                        out.append(inspect.getdoc(meth) or "")
    return [d.strip() for d in out if len(d.strip()) > 80]


def main() -> None:
    docs = [d for m in MODULES for d in docstrings(m)]
    text = "\n\n".join(docs) + "\n"
    (ASSETS / "corpus.txt").write_text(text, encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(ASSETS / "tokenizer.json"))
    print(f"{len(docs)} documents, {len(text)} characters, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
