"""Placeholders in a config: ``<your-bucket>``, ``<path-to-model-dir>``. The shipped job files and
examples mark what a user must fill in with ``<...>``; a value still holding one is refused
(before anything reads a file or a bucket) with the key and what to put there, so a copied
config cannot run against a stranger's bucket or an empty path."""

from __future__ import annotations

import dataclasses
import re

from raytrain_hybrid.errors import ConfigError

# ``<name>``: letters, digits, "-", "_" and "." between angle brackets, as the shipped files write them.
PLACEHOLDER = re.compile(r"<([A-Za-z][A-Za-z0-9_.-]*)>")

# What the shipped files' placeholders stand for; any other is spelled out from its name.
_MEANING = {
    "your-bucket": "your bucket",
    "path-to-model-dir": "a Hugging Face model directory (config.json, *.safetensors, tokenizer)",
    "path-to-chat-parquet": "a Parquet file or directory of chat rows (a messages column)",
}


def meaning(name: str) -> str:
    """What ``<name>`` asks for, in words: ``your-bucket`` -> ``your bucket``."""
    return _MEANING.get(name, name.replace("-", " ").replace("_", " ").lower())


def placeholders(value: object) -> list[str]:
    """The ``<...>`` names a string (or a list of strings) holds, in order."""
    if isinstance(value, str):
        return PLACEHOLDER.findall(value)
    if isinstance(value, (list, tuple)):
        return [name for item in value for name in placeholders(item)]
    return []


def refuse_placeholders(cfg) -> None:
    """Raise a ConfigError for the first key of ``cfg`` (a Config) whose value holds a placeholder:
    ``run.output_dir='s3://<your-bucket>/runs/8b': replace <your-bucket> with your bucket``."""
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        for field in dataclasses.fields(part):
            value = getattr(part, field.name)
            names = placeholders(value)
            if names:
                fill = "; ".join(f"replace <{n}> with {meaning(n)}" for n in dict.fromkeys(names))
                where = "in the config file or with --set"
                raise ConfigError(f"{section.name}.{field.name}", value, f"{fill} ({where})")
