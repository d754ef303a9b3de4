"""Finding and checking checkpoints on the driver, before anything starts.

A checkpoint whose files do not match its manifest (missing, truncated, corrupted) is
refused with the file named; a run directory means its newest intact checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

from raytrain_hybrid.config import layout_dict
from raytrain_hybrid.errors import ConfigError

MANIFEST = "manifest.json"


FORMAT = 1


_STEP_DIR = re.compile(r"^step_(\d+)$")


# The layout a manifest records; a checkpoint resumed under the same one reads its shards as they are.
MANIFEST_LAYOUT = ("dp", "tp", "pp", "schedule", "zero", "virtual_stages", "microbatches")


def layout_of(cfg) -> dict:
    return layout_dict(cfg.parallelism, MANIFEST_LAYOUT)


def read_manifest(path: str | Path) -> dict:
    """The manifest of a checkpoint directory (unverified: see ``verify`` for the driver's check)."""
    return json.loads((Path(path) / MANIFEST).read_text())


def file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def step_dirs(root: Path) -> list[Path]:
    """Complete-looking ``step_<N>`` directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def verify(path: Path, key: str = "--resume") -> dict:
    """The manifest of a checkpoint whose every file is there, whole and unchanged."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ConfigError(
            key, str(path), f"is not a complete checkpoint: {MANIFEST} is missing (a save was cut short?)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(key, str(path), f"has an unreadable {MANIFEST}: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise ConfigError(
            key, str(path), f"has checkpoint format {manifest.get('format')}; this version reads {FORMAT}"
        )
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise ConfigError(key, str(path), f"is missing the shard {name} (of {len(files)} files)")
        got = file_digest(f)
        if got["size"] != want["size"]:
            raise ConfigError(key, str(path), f"has a truncated {name}: {got['size']} bytes, {want['size']} written")
        if got["sha256"] != want["sha256"]:
            raise ConfigError(key, str(path), f"has a corrupted {name}: its SHA-256 differs from the one written")
    return manifest


def resolve(path: str | Path, key: str = "--resume") -> tuple[Path, dict]:
    """A checkpoint directory, or a run directory meaning its newest complete checkpoint."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise ConfigError(key, str(path), "does not exist; give a run directory or a checkpoints/step_<N> directory")
    if (path / MANIFEST).exists() or _STEP_DIR.match(path.name) or path.name.endswith(".partial"):
        return path, verify(path, key)
    candidates = step_dirs(path / "checkpoints") or step_dirs(path)
    if not candidates:
        raise ConfigError(key, str(path), "holds no checkpoints (checkpoints/step_<N>/); was checkpoint.interval set?")
    errors = []
    for candidate in reversed(candidates):  # newest complete one
        try:
            return candidate, verify(candidate, key)
        except ConfigError as exc:
            errors.append(exc.fix)
    raise ConfigError(key, str(path), f"holds no intact checkpoint: {'; '.join(errors)}")


def check_compatible(cfg, manifest: dict, path: Path) -> None:
    """The checkpoint's model must be this config's model; the run must have steps left."""
    saved = manifest["config"]["model"]
    for field in dataclasses.fields(cfg.model):
        have = getattr(cfg.model, field.name)
        if saved.get(field.name) != have:
            raise ConfigError(
                f"model.{field.name}",
                have,
                f"the checkpoint {path} was written for model.{field.name}={saved.get(field.name)!r}; "
                "resume with the model it was trained with (its config is in its manifest.json)",
            )
    if manifest["step"] >= cfg.train.steps:
        raise ConfigError(
            "train.steps",
            cfg.train.steps,
            f"the checkpoint {path} has done {manifest['step']} steps already; raise train.steps to continue",
        )
