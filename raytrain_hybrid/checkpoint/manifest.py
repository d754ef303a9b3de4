"""Finding and checking checkpoints on the driver, before anything starts.

A checkpoint whose files do not match its manifest (missing, truncated, corrupted) is
refused with the file named; a run directory means its newest intact checkpoint. The same
checks read a local directory, a shared mount or object storage (raytrain_hybrid.storage);
the manifest is written last, so a checkpoint without one was cut short.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import posixpath
import re
from pathlib import Path

import pyarrow.fs as pafs

from raytrain_hybrid.config import layout_dict
from raytrain_hybrid.config.nesting import too_deep
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import Store, as_store, is_uri

MANIFEST = "manifest.json"


FORMAT = 1


_STEP_DIR = re.compile(r"^step_(\d+)$")


# The layout a manifest records; a checkpoint resumed under the same one reads its shards as they are.
MANIFEST_LAYOUT = ("dp", "tp", "pp", "schedule", "zero", "virtual_stages", "microbatches")


def layout_of(cfg) -> dict:
    return layout_dict(cfg.parallelism, MANIFEST_LAYOUT)


def read_manifest(path: str | Path | Store) -> dict:
    """The manifest of a checkpoint directory (unverified: see ``verify`` for the driver's check)."""
    return json.loads(as_store(path).child(MANIFEST).read_text())


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def manifest_problem(manifest) -> str | None:
    """What makes ``manifest`` (parsed JSON) other than a manifest the trainer writes, or None:
    every value the driver and the workers read from it, checked for its type and range before
    any of them is used (a step of Infinity, a size of 1e400, a step of "2" or 2.5, no config)."""
    if not isinstance(manifest, dict):
        return f"it is a JSON {type(manifest).__name__}, not an object"
    if where := too_deep(manifest):
        return f"it nests deeper than any the trainer writes (at {where[:200]})"
    for name, least in (("step", 0), ("world_size", 1), ("data_origin", 0)):
        if (name in manifest or name != "data_origin") and not _whole(manifest.get(name), least):
            return f'"{name}" is {_shown(manifest.get(name))}; it must be a whole number >= {least}'
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f'"files" is {_shown(files)}; it must map each file of the checkpoint to its size and SHA-256'
    for name, want in files.items():
        if not isinstance(want, dict) or not _whole(want.get("size"), 0):
            return f'"files" gives {name!r} as {_shown(want)}; each must be {{"size": bytes >= 0, "sha256": ...}}'
        if not isinstance(want.get("sha256", ""), str):
            return f'"files" gives {name!r} a SHA-256 of {_shown(want["sha256"])}, not a string'
    config = manifest.get("config")
    if not isinstance(config, dict):
        return f'"config" is {_shown(config)}; it must be the config of the run (an object of sections)'
    for section, body in config.items():
        if not isinstance(body, dict):
            return f'"config.{section}" is {_shown(body)}; each section must be an object of keys'
    for name in ("trajectory", "layout", "data_position"):
        if name in manifest and not isinstance(manifest[name], dict):
            return f'"{name}" is {_shown(manifest[name])}; it must be an object'
    for record in manifest.get("steps", []) if isinstance(manifest.get("steps", []), list) else [None]:
        step = record.get("step") if isinstance(record, dict) else None
        if not _whole(step, 0) or step >= manifest["step"]:
            before = manifest["step"]
            return f'"steps" holds {_shown(record)}; each must be a step\'s metrics with a "step" before {before}'
    return None


def file_digest(path: str | Path | Store) -> dict:
    f = as_store(path)
    h = hashlib.sha256()
    size = 0
    with f.open_input() as stream:
        for chunk in iter(lambda: stream.read(1 << 22), b""):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def step_number(path: str | Path | Store) -> int | None:
    """N of a ``step_<N>`` directory name, else None."""
    m = _STEP_DIR.match(as_store(path).name)
    return int(m.group(1)) if m else None


def step_dirs(root: str | Path | Store) -> list[Store]:
    """Complete-looking ``step_<N>`` directories under ``root``, oldest first."""
    root = as_store(root)
    found = [(int(m.group(1)), root.child(n)) for n in root.listdir() if (m := _STEP_DIR.match(n))]
    return [p for _, p in sorted(found) if p.is_dir()]


# Up to this many bytes, the driver's check reads every file for its SHA-256; a larger checkpoint
# (a 70B run's is ~850 GB) is checked by sizes and metadata, which each rank's reads then rely on:
# hashing it would stream the whole checkpoint through the driver's node at every resume.
DIGEST_LIMIT_BYTES = 64 << 30


def verify(path: str | Path | Store, key: str = "--resume", digests: bool | None = None) -> dict:
    """The manifest of a checkpoint whose every file is there, whole and unchanged, whose DCP
    metadata is data this trainer reads (checkpoint.reader: tensors only, no code), and whose
    every shard entry is the tensor that metadata describes (its archive's directory and
    description read, a few small reads an entry, never the tensors' bytes).

    ``digests``: also compare every file's SHA-256 (None: when the checkpoint holds at most
    DIGEST_LIMIT_BYTES; the manifest it returns then says ``verified: "sizes"``); False: sizes
    only (a worker group's restart: a listing and the metadata, no reads of shards)."""
    path = as_store(path, key)
    manifest_path = path.child(MANIFEST)
    if not manifest_path.is_file():
        raise ConfigError(
            key, str(path), f"is not a complete checkpoint: {MANIFEST} is missing (a save was cut short?)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise ConfigError(key, str(path), f"has an unreadable {MANIFEST}: {exc!r}") from None
    except RecursionError:  # json parses nested arrays and objects by recursion
        raise ConfigError(key, str(path), f"has a {MANIFEST} nested deeper than any the trainer writes") from None
    if isinstance(manifest, dict) and manifest.get("format") != FORMAT:
        raise ConfigError(
            key, str(path), f"has checkpoint format {_shown(manifest.get('format'))}; this version reads {FORMAT}"
        )
    if problem := manifest_problem(manifest):
        raise ConfigError(key, str(path), f"has a {MANIFEST} that is not one the trainer writes: {problem}")
    files = manifest["files"]
    sizes = {name: want["size"] for name, want in files.items()}
    for name in sorted(files):
        if name != posixpath.basename(name) or name in ("", ".", ".."):
            raise ConfigError(key, str(path), f"has a {MANIFEST} naming {name!r}, not a file of the checkpoint")
    _refuse_links_out(path, [MANIFEST, *files], key)
    # One listing for the sizes (on object storage one request, not one per file).
    on_storage = {i.base_name: i for i in path.fs.get_file_info(pafs.FileSelector(path.path)) if i.is_file}
    if digests is None:
        digests = sum(sizes.values()) <= DIGEST_LIMIT_BYTES
    for name, want in sorted(files.items()):
        got = on_storage.get(name)
        if got is None:
            raise ConfigError(key, str(path), f"is missing the shard {name} (of {len(files)} files)")
        if got.size != sizes[name]:
            raise ConfigError(key, str(path), f"has a truncated {name}: {got.size} bytes, {sizes[name]} written")
        if digests and file_digest(path.child(name))["sha256"] != want.get("sha256"):
            raise ConfigError(key, str(path), f"has a corrupted {name}: its SHA-256 differs from the one written")
    md = _check_metadata(path, files, key)
    if digests is not False:  # (a worker group's restart reads no shard here; its reader refuses the same)
        _check_entries(path, md, key)
    return {**manifest, "verified": "sha256" if digests else "sizes"}


def _refuse_links_out(path: Store, names: list[str], key: str) -> None:
    """On a local disk, a file of the checkpoint that is a link to somewhere outside it: a
    planted link to another file (a key, another run's weights) would be read as a shard."""
    if not path.local:
        return
    root = os.path.realpath(path.path)
    for name in names:
        file = os.path.join(path.path, name)
        if os.path.islink(file) and os.path.dirname(os.path.realpath(file)) != root:
            raise ConfigError(
                key,
                str(path),
                f"has {name} as a link to {os.path.realpath(file)}, outside the checkpoint (nothing read)",
            )


def _check_metadata(path: Store, files: dict, key: str):
    """DCP's .metadata read as data (never as code), and naming only shards the manifest lists."""
    from raytrain_hybrid.checkpoint.reader import METADATA, UnsafeCheckpoint, parse_metadata

    if METADATA not in files:
        raise ConfigError(key, str(path), f"has a {MANIFEST} that does not list {METADATA}")
    try:
        md = parse_metadata(path.child(METADATA).read_bytes())
    except UnsafeCheckpoint as exc:
        raise ConfigError(key, str(path), f"is refused: its {METADATA} {exc} (nothing was loaded)") from None
    unlisted = sorted({info.relative_path for info in md.storage_data.values()} - set(files))
    if unlisted:
        raise ConfigError(key, str(path), f"has a {METADATA} naming shards its {MANIFEST} does not list: {unlisted}")
    if problem := _metadata_misfits(md, files):
        raise ConfigError(key, str(path), f"is refused: its {METADATA} {problem} (nothing was loaded)")
    return md


def _check_entries(path: Store, md, key: str) -> None:
    """Every shard entry is the tensor the metadata describes (checkpoint.entry_ranges), on the
    driver: a pickle planted in a shard is refused here, naming the file, before any worker starts."""
    from raytrain_hybrid.checkpoint.entry_ranges import entries_problem

    if problem := entries_problem(path, md):
        raise ConfigError(key, str(path), f"is refused: {problem} (nothing was loaded)")


def _metadata_misfits(md, files: dict) -> str | None:
    """What in the metadata cannot be so, given the files' sizes the manifest lists: a byte range
    past the end of its shard (a shard cut to nothing, its manifest rewritten to match), a tensor
    whose shape holds more bytes than all of its stored ranges (an absurd shape), a chunk outside
    its tensor. Checked here, on the driver, so that such a checkpoint never reaches a worker."""
    stored: dict[str, int] = {}
    for index, info in md.storage_data.items():
        size = files[info.relative_path]["size"]
        if info.offset + info.length > size:
            return (
                f"locates {index.fqn!r} at bytes {info.offset}..{info.offset + info.length} of "
                f"{info.relative_path}, which holds {size}"
            )
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    for fqn, entry in md.state_dict_metadata.items():
        shape = list(entry.size)
        if any(type(d) is not int or d < 0 for d in shape):
            return f"gives {fqn!r} the shape {shape}"
        itemsize = torch_itemsize(entry.properties.dtype)
        if math.prod(shape) * itemsize > stored.get(fqn, 0):
            return f"gives {fqn!r} the shape {shape}: {math.prod(shape) * itemsize:,} bytes, more than its shards store"
        for chunk in entry.chunks:
            if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
                return f"has a chunk of {fqn!r} with another number of dimensions than {shape}"
            if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape, strict=True)):
                return f"has a chunk of {fqn!r} at {list(chunk.offsets)} of {list(chunk.sizes)}, outside {shape}"
    return None


def torch_itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def resolve(path: str | Path | Store, key: str = "--resume") -> tuple[Store, dict]:
    """A checkpoint directory, or a run directory meaning its newest complete checkpoint
    (local, a mount, or a URI such as s3://bucket/run)."""
    if not isinstance(path, Store) and not is_uri(str(path)):
        path = Path(path).expanduser().resolve()
    path = as_store(path, key)
    if not path.exists():
        raise ConfigError(key, str(path), "does not exist; give a run directory or a checkpoints/step_<N> directory")
    if path.child(MANIFEST).exists() or _STEP_DIR.match(path.name) or path.name.endswith(".partial"):
        return path, verify(path, key)
    candidates = step_dirs(path.child("checkpoints")) or step_dirs(path)
    if not candidates:
        raise ConfigError(key, str(path), "holds no checkpoints (checkpoints/step_<N>/); was checkpoint.interval set?")
    errors = []
    for candidate in reversed(candidates):  # newest complete one
        try:
            return candidate, verify(candidate, key)
        except ConfigError as exc:
            errors.append(f"{candidate.name} {exc.fix}")
    raise ConfigError(key, str(path), f"holds no intact checkpoint: {'; '.join(errors)}")


def check_compatible(cfg, manifest: dict, path: str | Path | Store, *, done_ok: bool = False) -> None:
    """The checkpoint's model (and LoRA adapters) must be this config's; the run must have steps
    left (``done_ok``: the caller decides what a finished run's resume does, see done_already)."""
    for section in ("model", "lora"):  # a LoRA checkpoint holds adapters of one shape, on one base
        saved = manifest["config"].get(section, {})
        for field in dataclasses.fields(getattr(cfg, section)):
            have = getattr(getattr(cfg, section), field.name)
            # A key newer than the checkpoint was, when it was written, at its default.
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            was = saved.get(field.name, default)
            if was != have:
                raise ConfigError(
                    f"{section}.{field.name}",
                    have,
                    f"the checkpoint {path} was written for {section}.{field.name}={was!r}; "
                    f"resume with the {section} settings it was trained with (its config is in its manifest.json)",
                )
    if manifest["step"] >= cfg.train.steps and not done_ok:
        raise done_already(cfg.train.steps, manifest, path)


def done_already(steps: int, manifest: dict, path: str | Path | Store) -> ConfigError:
    """The refusal of a resume with no step left to train (``steps``: its train.steps)."""
    return ConfigError(
        "train.steps",
        steps,
        f"the checkpoint {path} has done {manifest['step']} steps already; raise train.steps to continue "
        "(with --allow-change train.steps: the learning-rate schedule is stretched to the new length)",
    )
