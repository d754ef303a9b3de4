"""What defines a run's trajectory, recorded in every checkpoint and compared on resume.

A resumed run must continue the run it resumes: the same batches in the same order at the same
learning rate. Today's config is compared with the checkpoint's before any worker starts; a
difference is refused, naming the key, both values and the flag that allows it on purpose
(``train --allow-change KEY``). train.steps is one too: it is the learning-rate schedule's
horizon, and raising it stretches the cosine decay, so the learning rate would rise again at the
resumed step instead of going on down (0.000300 -> 0.000355 in a 12 -> 24 step run).

Data is compared by what it is, not where it is: a digest of the listing of data.path (file
names relative to it, and sizes), one of the files' content, sampled cheaply (each file's first
4 KiB and last 64 KiB: a Parquet file's footer holds its schema, row count and every column
chunk's statistics), and one of the tokenizer file raw text goes through, so moving the same files to
another bucket resumes, and replacing them (a file of the same size too) does not, silently.
What cannot be read now is said as not verified.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow.fs as pafs

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import as_store

# Which columns of the data a run reads, and which of its examples: another column of the same files
# is other data.
COLUMN_KEYS = (
    "data.text_column",
    "data.token_column",
    "data.messages_column",
    "data.prompt_column",
    "data.completion_column",
    "data.drop_long_prompts",
    "data.text_columns",
    "data.tabular_columns",
    "data.label_column",
)
# Config keys whose value shapes the batches, their order, the learning rate at each step or the
# update itself (weight decay, the clipping bound, the precision of the step's arithmetic).
CONFIG_KEYS = (
    "train.global_batch_size",
    "train.seed",
    "train.lr",
    "train.min_lr_ratio",
    "train.warmup_steps",
    "data.shuffle_seed",
    "data.shuffle_buffer",
    "data.format",
    "data.epochs",
    "data.packing",
    "train.weight_decay",
    "train.grad_clip",
    "train.dtype",
    "train.fp8",
    "train.fp8_emulate",
    "train.steps",
    *COLUMN_KEYS,
)
# Recorded digests: the data files under data.path, and the tokenizer (None: could not be read).
DATA_KEY, TOKENIZER_KEY = "data.path", "data.tokenizer"
CONTENT_KEY = "data.content"  # the data files' sampled content: compared, and allowed, as data.path
SAMPLE_BYTES = 64 << 10
# The keys that say which data, in which order.
DATA_KEYS = (
    DATA_KEY,
    CONTENT_KEY,
    TOKENIZER_KEY,
    "data.shuffle_seed",
    "data.shuffle_buffer",
    "data.format",
    "data.epochs",
    "data.packing",
    *COLUMN_KEYS,
)
ALLOWABLE = (*CONFIG_KEYS, DATA_KEY, TOKENIZER_KEY)
# Allowed changes after which the data starts from its beginning: skipping the steps done means
# nothing in another data set, order or batch size.
RESTARTS_DATA = (*DATA_KEYS, "train.global_batch_size")


def _value(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _digest(parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def data_digest(path: str) -> str | None:
    """The listing of data.path (names relative to it, sizes), as a digest; "memory" as itself."""
    if path in ("memory", "builtin", ""):
        return path
    try:
        store = as_store(path, DATA_KEY)
        info = store.fs.get_file_info(store.path)
        if info.type == pafs.FileType.File:
            return _digest([[info.base_name, info.size]])
        infos = store.fs.get_file_info(pafs.FileSelector(store.path, recursive=True))
    except (OSError, ConfigError):
        return None
    root = store.path.rstrip("/") + "/"
    return _digest(sorted([i.path.removeprefix(root), i.size] for i in infos if i.type == pafs.FileType.File))


def data_content_digest(path: str) -> str | None:
    """The content of the files under data.path, sampled: each file's first 4 KiB and last
    SAMPLE_BYTES (range reads, 16 files at a time on object storage), as a digest."""
    from concurrent.futures import ThreadPoolExecutor

    if path in ("memory", "builtin", ""):
        return path
    try:
        store = as_store(path, DATA_KEY)
        info = store.fs.get_file_info(store.path)
        if info.type == pafs.FileType.File:
            infos = [info]
        else:
            infos = store.fs.get_file_info(pafs.FileSelector(store.path, recursive=True))
        files = sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path)

        def sample(i) -> str:
            with store.fs.open_input_file(i.path) as f:
                head = f.read_at(min(4096, i.size), 0)
                tail = f.read_at(min(SAMPLE_BYTES, i.size), max(0, i.size - SAMPLE_BYTES))
            return hashlib.sha256(head + tail).hexdigest()

        with ThreadPoolExecutor(16) as pool:
            return _digest(list(pool.map(sample, files)))
    except (OSError, ConfigError):
        return None


def tokenizer_digest(cfg) -> str | None:
    """The tokenizer.json raw text goes through (the shipped one by default), as a digest."""
    from raytrain_hybrid.data.tokenizer import DEFAULT_TOKENIZER, tokenizer_source

    if cfg.data.text_columns:  # classifiers: the pretrained model's tokenizer is part of model.pretrained
        return None
    source = tokenizer_source(cfg) or str(DEFAULT_TOKENIZER)
    try:
        store = as_store(source, TOKENIZER_KEY)
        if not source.endswith(".json"):
            store = store.child("tokenizer.json")
        return hashlib.sha256(store.read_bytes()).hexdigest()
    except (OSError, ConfigError):
        return None


def describe(cfg) -> dict:
    """The trajectory of a run with this (resolved) config, as the manifest records it."""
    return {
        **{key: _value(cfg, key) for key in CONFIG_KEYS},
        DATA_KEY: data_digest(cfg.data.path),
        CONTENT_KEY: data_content_digest(cfg.data.path),
        TOKENIZER_KEY: tokenizer_digest(cfg),
    }


def recorded(manifest: dict) -> dict:
    """A checkpoint's trajectory: its own record, else (older checkpoints) its config's keys."""
    if "trajectory" in manifest:
        return manifest["trajectory"]
    saved = manifest["config"]
    return {key: saved.get(key.split(".")[0], {}).get(key.split(".")[1]) for key in CONFIG_KEYS}


def check_allowed(allowed: list[str]) -> list[str]:
    """``--allow-change`` values, split at commas, each a key of the trajectory."""
    keys = [k.strip() for item in allowed for k in item.split(",") if k.strip()]
    for key in keys:
        if key not in ALLOWABLE:
            raise ConfigError("--allow-change", key, f"is not a key a resume compares; one of {', '.join(ALLOWABLE)}")
    return keys


def check_trajectory(
    cfg,
    manifest: dict,
    path,
    allowed: list[str],
    unverified: list[str] | None = None,
    unrecorded: list[str] | None = None,
) -> list[str]:
    """Refuse a resume that would change the run's trajectory unless the key is allowed;
    returns the changes that were allowed (said to the user, and the data ones restart the data).
    ``unverified``: where what the checkpoint recorded cannot be read now (its keys are noted);
    ``unrecorded``: where it could not be read when the checkpoint was saved (nothing to compare)."""
    saved, now = recorded(manifest), describe(cfg)
    changed = []
    # train.steps last: a resume that changes another key as well is told about that one first
    for recorded_key, before in sorted(saved.items(), key=lambda item: item[0] == "train.steps"):
        after = now.get(recorded_key)
        key = DATA_KEY if recorded_key == CONTENT_KEY else recorded_key  # the content is data.path's
        if before is not None and after is None and unverified is not None and key not in unverified:
            unverified.append(key)  # recorded then, cannot be read now: said, not claimed
        unread = before is None and after is not None and recorded_key in (DATA_KEY, CONTENT_KEY, TOKENIZER_KEY)
        if unread and unrecorded is not None and key not in unrecorded:
            unrecorded.append(key)  # unreadable when saved: said, not claimed
        if before is None or after is None or before == after:  # a digest that could not be read: no claim
            continue
        if key in allowed:
            if key not in changed:
                changed.append(key)
            continue
        if key in CONFIG_KEYS:
            was = f"the checkpoint {path} was trained with {key}={before!r}"
        else:
            what = "the files under it" if key == DATA_KEY else "its tokenizer.json"
            was = f"{what} differ from those the checkpoint {path} was trained with"
        then = "the data from its beginning" if key in RESTARTS_DATA else "the new value from the next step on"
        if key == "train.steps":  # the horizon: the cosine decay is stretched, the learning rate rises
            then = "the learning-rate schedule stretched to the new length from the next step on"
        raise ConfigError(
            key,
            _value(cfg, key),
            f"{was}; resuming would change the run silently. Resume with the checkpoint's value, or give "
            f"--allow-change {key} to take {then}",
        )
    return changed


def data_restarts(changed: list[str]) -> bool:
    """Whether an allowed change starts the data from its beginning (a new data set or order)."""
    return any(key in RESTARTS_DATA for key in changed)
