"""Hugging Face language-model checkpoints (``model.pretrained``): where they are, which
architecture and sizes they fix, and where each engine parameter's values lie in them.

A checkpoint is a directory (local, or an object-store URI) with ``config.json`` and
safetensors weights, one ``model.safetensors`` or ``model-0000x-of-0000y.safetensors``
shards. This module reads only ``config.json`` and directory listings; the weights are read
slice by slice into each rank's shards by ``checkpoint.hf_load``.

It sits below the storage layer (config resolution reads ``config.json`` before any storage
object exists), so a URI is opened with ``pyarrow.fs`` itself, the library
``raytrain_hybrid.storage`` wraps: endpoint and credentials come from the same environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from raytrain_hybrid.errors import ConfigError

KEY = "model.pretrained"
SAFETENSORS = ".safetensors"
# train.lr = 0 picks this when fine-tuning a checkpoint (TRL's SFTConfig default).
FINETUNE_LR = 2e-5


def is_set(pretrained: str) -> bool:
    """``model.pretrained`` names a checkpoint ("" and "none": random weights, for the LMs)."""
    return bool(pretrained) and pretrained.lower() != "none"


def _is_uri(location: str) -> bool:
    return "://" in location


def _listing(location: str) -> tuple[list[str], Callable[[str], bytes]]:
    """The file names in ``location`` and a reader of one of them (name -> bytes)."""
    if _is_uri(location):
        import pyarrow.fs as pafs

        fs, root = pafs.FileSystem.from_uri(location)
        root = root.rstrip("/")
        try:
            infos = fs.get_file_info(pafs.FileSelector(root, recursive=False))
        except (FileNotFoundError, OSError):
            infos = []
        names = [i.base_name for i in infos if i.type == pafs.FileType.File]

        def read(name: str) -> bytes:
            with fs.open_input_stream(f"{root}/{name}") as f:
                return f.read()

        return names, read
    path = Path(location).expanduser()
    names = [p.name for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    return names, lambda name: (path / name).read_bytes()


def read_config_json(location: str) -> dict:
    """The checkpoint's config.json (all that resolving and checking a config needs: ``check``
    and the planner work from it alone); refuses a directory without one."""
    names, read = _listing(location)
    if "config.json" not in names:
        raise ConfigError(
            KEY,
            location,
            "has no config.json; give a Hugging Face model directory (config.json + *.safetensors), "
            "local or a storage URI, or none for random weights",
        )
    return json.loads(read("config.json"))


def check_weights(location: str) -> None:
    """Refuse a checkpoint without safetensors weights (before any worker starts, and on load)."""
    names, _ = _listing(location)
    if not any(n.endswith(SAFETENSORS) for n in names):
        other = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = f" (it has {other[0]}: save it with save_pretrained(dir, safe_serialization=True))" if other else ""
        raise ConfigError(KEY, location, f"has no *.safetensors weights next to config.json{hint}")


def local_dir(location: str) -> Path:
    """Where this node reads the checkpoint: the directory itself, or for a URI the node-local
    copy ``checkpoint.hf_load.fetch_pretrained`` makes (one per node, shared by its ranks)."""
    if not _is_uri(location):
        return Path(location).expanduser().resolve()
    key = hashlib.sha256(location.encode()).hexdigest()[:16]
    name = location.rstrip("/").rsplit("/", 1)[-1]
    return Path(tempfile.gettempdir()) / "raytrain-hybrid-pretrained" / f"{name}-{key}"


def arch_of(model_type: str, location: str) -> str:
    """The registry's architecture for the ``model_type`` of the checkpoint at ``location``."""
    from raytrain_hybrid.models import arch_names, get_arch

    supported = {}
    for name in arch_names("lm"):
        for mt in get_arch(name).hf_model_types:
            supported[mt] = name
    if model_type not in supported:
        bert = " (a BERT checkpoint is for the classifier: model.arch=multimodal-bert)" if model_type == "bert" else ""
        raise ConfigError(
            KEY, location, f"model_type {model_type!r} has no spec; supported: {', '.join(sorted(supported))}{bert}"
        )
    return supported[model_type]


def resolve(model, given: set[str] | None = None):
    """``model`` (a ModelConfig) with the architecture and sizes of its checkpoint; a key the
    user named (``given``; None: a key set to something else than its default) must agree with
    the checkpoint's value: `model.num_layers=4` is refused for a 32-layer checkpoint although
    4 is the default."""
    from raytrain_hybrid.models import get_arch

    if not is_set(model.pretrained) or get_arch(model.arch).task != "lm":
        return model
    conf = read_config_json(model.pretrained)
    arch = arch_of(conf.get("model_type", "?"), model.pretrained)
    spec = get_arch(arch)
    # A local path made absolute: workers (Ray's, elsewhere) do not run in this directory.
    where = model.pretrained if _is_uri(model.pretrained) else str(local_dir(model.pretrained))
    want = {"arch": arch, **spec.sizes_from_hf(conf)}
    defaults = type(model)()
    for key, value in want.items():
        mine = getattr(model, key)
        named = key in given if given is not None else mine != getattr(defaults, key)
        if named and mine != value:
            raise ConfigError(
                f"model.{key}",
                mine,
                f"disagrees with the checkpoint {model.pretrained}, whose value is {value!r}; "
                f"drop model.{key} (the checkpoint's config.json sets it) or set it to {value!r}",
            )
    limit = spec.max_seq_len(conf)
    if limit and model.seq_len > limit:
        raise ConfigError(
            "model.seq_len", model.seq_len, f"exceeds what the checkpoint {model.pretrained} attends over ({limit})"
        )
    return dataclasses.replace(model, pretrained=where, **want)


def checkpoint_config(config_cls, location: str, **overrides):
    """The transformers config of a checkpoint, RoPE scaling and every other setting kept, with
    the engine's overrides (untied head: embedding and head live on different stages)."""
    # The engine holds fp32 master weights: the checkpoint's storage dtype is not the model's.
    dropped = ("architectures", "transformers_version", "torch_dtype", "dtype")
    conf = {k: v for k, v in read_config_json(location).items() if k not in dropped}
    conf.update(tie_word_embeddings=False, use_cache=False, **overrides)
    return config_cls(**conf, attn_implementation="sdpa")
