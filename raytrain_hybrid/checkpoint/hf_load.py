"""Pretrained Hugging Face weights straight into each rank's shards (``model.pretrained``).

Each rank reads, from the checkpoint's safetensors files, only the slices of the tensors it
holds after TP, PP and FSDP/ZeRO are applied: ``dcp.load`` with ``checkpoint.hf_reader``'s
``RangeReader``, which reads each file's header and each slice by byte range, from a local
directory or straight from object storage (nothing is downloaded whole, nothing staged on
the node's disk). No rank builds a full parameter. The architecture spec's ``from_hf`` says
where an engine parameter lies in the checkpoint (its key, transposed or not, at which
offset: GPT-2's Conv1D weights and fused q/k/v); a small planner turns each rank's local
chunks into read requests on those keys.

A Hugging Face Hub id is downloaded once per node into that node's Hugging Face cache, then
read there like a local directory.
"""

from __future__ import annotations

import fcntl
import hashlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from raytrain_hybrid.checkpoint.hf_reader import RangeReader
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import hub
from raytrain_hybrid.models.hf_checkpoint import KEY, check_weights, local_dir, read_config_json
from raytrain_hybrid.models.lora import base_name
from raytrain_hybrid.storage import Store, as_store, is_uri, private_dir


def fetch_pretrained(location: str, revision: str = "") -> Path | Store:
    """Where this node reads the checkpoint: a local directory as it is, a Hub id's snapshot in
    this node's Hugging Face cache (ranks of one node take turns on a lock; the first
    downloads, the others find its files), an object-store URI as itself (a Store: each rank
    reads its slices from it by byte range)."""
    if hub.is_hub_id(location):
        # In this user's private directory: a lock at a predictable name in a shared /tmp could be
        # a link another user planted, and opening it for writing would truncate its target.
        key = hashlib.sha256(f"{location}@{revision}".encode()).hexdigest()[:16]
        lock_file = private_dir("pretrained") / f"{key}.lock"
        with open(lock_file, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = hub.snapshot(location, revision)
        check_weights(str(path))
        return path
    check_weights(location)
    if not is_uri(location):
        return local_dir(location)
    return as_store(location, KEY)  # read by range where it is (checkpoint.hf_reader)


class _SlicePlanner(DefaultLoadPlanner):
    """Reads, per checkpoint key, the chunks this rank holds (global offsets in the
    checkpoint tensor) into their destination views; nothing else of the state dict."""

    def __init__(self, targets: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> None:
        super().__init__()
        self.targets = targets

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for key, chunks in self.targets.items():
            md = self.metadata.state_dict_metadata[key]
            local = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape) for off, view in chunks]
            requests += create_read_items_for_chunk_list(key, md, local)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[index.fqn][index.index][1]


def _local_chunk(p: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """(global offset, this rank's values as a writable view) of a parameter."""
    if isinstance(p, DTensor):
        (chunk,) = p.__create_chunk_list__()  # one local shard per rank (TP, FSDP, both)
        return tuple(chunk.offsets), p._local_tensor.detach()
    return (0,) * p.dim(), p.detach()


def _add_part(targets: dict, key: str, stored: tuple, part: tuple, p: torch.Tensor, location: str) -> None:
    """Read checkpoint tensor ``key`` into ``p[part]`` (an int or a slice per leading dimension:
    a mixture of experts' stacked weights hold one checkpoint tensor per expert and projection),
    as far as this rank's shard of ``p`` overlaps it."""
    start, view = _local_chunk(p)
    index, offset, shape = [], [], []
    for d, size in enumerate(p.shape):
        sel = part[d] if d < len(part) else slice(None)
        if isinstance(sel, tuple):  # ("split", j, n): the j-th of n equal parts of this dimension
            _, j, n = sel
            sel = slice(j * size // n, (j + 1) * size // n)
        lo, hi = (sel, sel + 1) if isinstance(sel, int) else (sel.start or 0, size if sel.stop is None else sel.stop)
        a, b = max(lo, start[d]), min(hi, start[d] + view.shape[d])
        if isinstance(sel, int):
            index.append(sel - start[d])
        else:
            shape.append(hi - lo)
            index.append(slice(a - start[d], b - start[d]))
            offset.append(a - lo)
        if a >= b:
            return  # not on this rank
    if tuple(shape) != stored:
        raise ConfigError(KEY, location, f"tensor {key!r} has shape {list(stored)}; the model needs {shape}")
    targets.setdefault(key, []).append((tuple(offset), view[tuple(index)]))


def load_hf_weights(stage: torch.nn.Module, spec, location: str, path: Path | Store) -> RangeReader:
    """Fill every parameter of ``stage`` (after parallelize and to_empty) from the checkpoint
    at ``path`` (``fetch_pretrained(location)``); returns the reader (its ``bytes_read``)."""
    import torch.distributed.checkpoint as dcp

    conf = read_config_json(str(path))
    reader = RangeReader(as_store(path, KEY))
    available = reader.read_metadata().state_dict_metadata
    targets: dict[str, list] = {}
    for name, p in stage.named_parameters():
        name = base_name(name.replace("_checkpoint_wrapped_module.", ""))
        if name is None:  # a LoRA adapter: not in the checkpoint (the trainer initialises it)
            continue
        where = spec.from_hf(name, conf)
        if isinstance(where, list):  # the parameter stacks several checkpoint tensors (experts)
            for key, part in where:
                if key not in available:
                    raise ConfigError(KEY, location, f"has no tensor {key!r} (for part of the engine's {name})")
                _add_part(targets, key, tuple(available[key].size), part, p, location)
            continue
        candidates, transposed, offset = where
        key = next((k for k in candidates if k in available), None)
        if key is None:
            raise ConfigError(KEY, location, f"has no tensor {candidates[0]!r} (for the engine's {name})")
        shape = tuple(reversed(p.shape)) if transposed else tuple(p.shape)
        stored = tuple(available[key].size)
        fits = stored == shape
        if offset:  # a block of a fused tensor: inside it
            fits = len(stored) == len(shape) and all(o + n <= s for o, n, s in zip(offset, shape, stored, strict=True))
        if not fits:
            raise ConfigError(KEY, location, f"tensor {key!r} has shape {list(stored)}; the model needs {list(shape)}")
        start, view = _local_chunk(p)
        if view.numel() == 0:  # an uneven FSDP shard can be empty
            continue
        if transposed:
            start, view = tuple(reversed(start)), view.t()
        if offset:
            start = tuple(s + o for s, o in zip(start, offset, strict=True))
        targets.setdefault(key, []).append((start, view))
    for name, buf in _persistent_buffers(stage):
        # A buffer the checkpoint holds (a router's score correction): read whole; one it does not
        # hold keeps the value the model computed at build.
        key = next((k for k in spec.from_hf(name, conf)[0] if k in available), None) if spec.from_hf else None
        if (
            key is not None
            and isinstance(spec.from_hf(name, conf), tuple)
            and tuple(available[key].size) == tuple(buf.shape)
        ):
            targets.setdefault(key, []).append(((0,) * buf.dim(), buf))
    with torch.no_grad():
        dcp.load({}, storage_reader=reader, planner=_SlicePlanner(targets), no_dist=True)
    return reader


def _persistent_buffers(stage: torch.nn.Module):
    """(global name, tensor) of the buffers a state dict holds (not rotary tables and the like)."""
    for mod_name, mod in stage.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                full = f"{mod_name}.{name}" if mod_name else name
                yield full.replace("_checkpoint_wrapped_module.", ""), buf
