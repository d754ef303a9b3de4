"""Sharded checkpoints with torch.distributed.checkpoint (DCP), loadable under any layout.

Every rank writes its own shards of the model and the AdamW state, keyed by global
parameter names (a stage keeps ``model.layers.3...`` whichever rank holds it), so a
checkpoint saved at (2, 2, 2) loads at (1, 1, 1) or (4, 1, 2): DCP reshards on load.

Layout of ``run.output_dir/checkpoints/step_<N>/`` (N = optimizer steps done):
- ``.metadata`` and ``__<rank>_0.distcp``: DCP's files;
- ``manifest.json``: the step, the config and layout it came from, the data position,
  and every file's size and SHA-256, gathered from all ranks.

A save goes to ``step_<N>.partial/`` and is renamed to ``step_<N>`` by rank 0 once
every rank's files and the manifest are written, so a crash mid-write never leaves a
directory that looks complete; a checkpoint whose files do not match its manifest
(missing, truncated, corrupted) is refused with the file named. DCP's own metadata is
a pickle: it is read with an unpickler that admits only DCP's metadata classes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from raytrain_hybrid.errors import ConfigError

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ---------------------------------------------------------------- state dicts (workers)


def _fqn(name: str) -> str:
    """A parameter's global name: without activation-checkpoint and DDP wrapper prefixes."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def model_state(modules) -> list[dict[str, torch.Tensor]]:
    """One state dict per stage module this rank holds (global names, DTensor shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [get_model_state_dict(m) for m in modules]


def optimizer_state(modules, optimizer) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state under global names, created (zeros, step 0) where the
    optimizer has not stepped yet, so that DCP can load into it. ZeRO-1 keeps flat slices
    per DP rank; it hands out (all-gathered) per-parameter state in the same form, so a
    checkpoint reshards to any layout and ZeRO stage."""
    gathered = optimizer.gathered_state() if hasattr(optimizer, "gathered_state") else None
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, p in module.named_parameters():
            if gathered is not None:
                state = gathered[id(p)]
            else:
                state = optimizer.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                out[f"{_fqn(name)}.{key}"] = state[key]
    return out


def _scatter_optimizer_state(modules, optimizer, flat: dict[str, torch.Tensor]) -> None:
    """After a load: hand ZeRO-1 its loaded per-parameter state back (others load in place)."""
    if not hasattr(optimizer, "scatter_state"):
        return
    per_param = {}
    for module in modules:
        for name, p in module.named_parameters():
            per_param[id(p)] = {key: flat[f"{_fqn(name)}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")}
    optimizer.scatter_state(per_param)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _training_state(trainer, rank: int, with_rng: bool) -> tuple[dict, list[dict]]:
    per_module = model_state(trainer.modules)
    state: dict[str, Any] = {
        "model": {k: v for sd in per_module for k, v in sd.items()},
        "optimizer": optimizer_state(trainer.modules, trainer.optimizer),
    }
    if with_rng:  # per rank: meaningful only when loaded by the same rank of the same layout
        state["rng"] = {f"rank{rank}": _rng_state(trainer.device)}
    return state, per_module


def layout_of(cfg) -> dict:
    par = cfg.parallelism
    return {"dp": par.dp, "tp": par.tp, "pp": par.pp, "schedule": par.schedule, "zero": par.zero,
            "virtual_stages": par.stages_per_rank, "microbatches": par.microbatches}  # fmt: skip


def read_manifest(path: str | Path) -> dict:
    """The manifest of a checkpoint directory (unverified: see ``verify`` for the driver's check)."""
    return json.loads((Path(path) / MANIFEST).read_text())


def _file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def save(trainer, cfg, step: int, *, launch_id: str, data_position: dict | None = None) -> tuple[Path, dict]:
    """Write checkpoint ``step_<step>`` of this run (every rank calls it); returns its directory
    and timings: ``write_s`` for DCP's write of the shards, ``save_s`` for all of it."""
    import time

    t0 = time.perf_counter()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(cfg.run.output_dir).resolve() / "checkpoints"
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save that died before this one
        partial.mkdir(parents=True)
    dist.barrier()
    state, _ = _training_state(trainer, rank, with_rng=True)
    dcp.save(state, checkpoint_id=str(partial))
    write_s = time.perf_counter() - t0
    # Each rank hashes the files it wrote; rank 0 records them all.
    mine = {p.name: _file_digest(p) for p in partial.iterdir() if p.name.startswith(f"__{rank}_")}
    if rank == 0:
        mine[".metadata"] = _file_digest(partial / ".metadata")
    files: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(files, mine)
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "launch_id": launch_id,
            "world_size": world,
            "layout": layout_of(cfg),
            "config": cfg.to_dict(),
            "data_position": data_position or {},
            "files": {name: d for part in files for name, d in part.items()},
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if final.exists():  # the same step of an earlier attempt of this run (after a restart)
            shutil.rmtree(final)
        os.rename(partial, final)  # atomic: the directory appears complete or not at all
    dist.barrier()
    return final, {"write_s": write_s, "save_s": time.perf_counter() - t0}


def load(trainer, cfg, path: str | Path) -> dict:
    """Load a verified checkpoint into this rank's modules and optimizer; returns its manifest."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(path)
    manifest = read_manifest(path)
    rank = dist.get_rank()
    same_layout = manifest["world_size"] == dist.get_world_size() and manifest["layout"] == layout_of(cfg)
    state, per_module = _training_state(trainer, rank, with_rng=same_layout)
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    for module, sd in zip(trainer.modules, per_module, strict=True):
        set_model_state_dict(module, sd, options=StateDictOptions(strict=True))
    _scatter_optimizer_state(trainer.modules, trainer.optimizer, state["optimizer"])
    if same_layout:
        rng = state["rng"][f"rank{rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)
    trainer.restore_schedule(manifest["step"])
    return manifest


# ---------------------------------------------------------------- DCP metadata, read safely


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch sizes, dtypes and layouts, and paths only."""

    _TORCH = {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    _OTHER = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in self._OTHER:
            return super().find_class(module, name)
        if module == "torch" and name in self._TORCH:
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint never holds")


def _layout(name: str):
    """torch.strided and friends, by name (how tensor properties pickle their layout)."""
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"checkpoint metadata names an unknown tensor layout {name!r}")
    return layout


def _reader_base():
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader


class SafeFileSystemReader(_reader_base()):
    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------- finding and checking (driver)


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
        got = _file_digest(f)
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
