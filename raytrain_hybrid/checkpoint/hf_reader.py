"""Safetensors slices read by byte range, from a local directory or object storage.

A safetensors file is an 8-byte little-endian length, a JSON header (each tensor's dtype,
shape and ``data_offsets``, counted from the end of the header) and the tensors' bytes in
row-major order. ``RangeReader`` is a DCP storage reader over such a directory (a ``Store``:
a local path, a mount, ``s3://``, ``gs://``): it reads each file's header by range (the
length, then the JSON) and, for each block a rank needs, only the bytes the block covers:

- a range of whole rows (every dimension after the first complete: FSDP's and PP's blocks,
  TP's column-wise split): one contiguous range, read 16 MiB at a time into one buffer;
- a block of columns (TP's row-wise split of ``o_proj``/``down_proj``): each row's segment is
  its own range, unless the holes between them are small against what they bring (at most a
  sixteenth): then whole rows, one range. On object storage the segments are fetched by a few
  threads at once (each a ranged GET).

Nothing is copied to the node's disk and nothing is memory-mapped (mapped pages count in the
rank's resident memory until the file closes). ``bytes_read`` counts what the reader fetched,
headers included. Small files (``config.json``, tokenizer files) are read whole elsewhere.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models.hf_checkpoint import KEY, SAFETENSORS
from raytrain_hybrid.storage import Store

# safetensors dtype names -> torch dtypes (the format's own table).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
BLOCK = 16 << 20  # bytes read at once (and the reused buffer's size)
HOLE_FRACTION = 16  # whole rows when the holes between row segments are at most 1/16 of them
THREADS = 8  # ranged reads in flight at once on object storage
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on a header


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie: its file, the absolute offset of its first byte, shape, dtype."""

    file: str
    start: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _bad(store: Store, name: str, what: str) -> ConfigError:
    return ConfigError(KEY, str(store), f"{name} is not a readable safetensors file: {what}")


def read_header(store: Store, name: str, f) -> tuple[dict, int]:
    """(the JSON header, the offset of the first data byte) of an open safetensors file."""
    size = f.size()
    if size < 8:
        raise _bad(store, name, f"{size} bytes")
    n = int.from_bytes(f.read_at(8, 0), "little")
    if n > _HEADER_LIMIT or 8 + n > size:
        raise _bad(store, name, f"a header of {n} bytes in a file of {size}")
    try:
        header = json.loads(f.read_at(n, 8))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(store, name, f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(store, name, "its header is not a table of tensors")
    data_size = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        ok = isinstance(info, dict) and info.get("dtype") in DTYPES and isinstance(info.get("shape"), list)
        ok = ok and all(isinstance(d, int) and d >= 0 for d in info["shape"])
        offsets = info.get("data_offsets") if ok else None
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
        if ok:
            begin, end = offsets
            nbytes = math.prod(info["shape"]) * DTYPES[info["dtype"]].itemsize
            ok = 0 <= begin <= end <= data_size and end - begin == nbytes
        if not ok:
            raise _bad(store, name, f"tensor {key!r} has a malformed or out-of-file entry {info!r:.200}")
    return header, 8 + n


class RangeReader(StorageReader):
    """DCP's storage reader for a Hugging Face safetensors directory on any storage, reading
    headers and the requested blocks by byte range (see the module's docstring)."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.remote = not store.local
        self.bytes_read = 0
        self.storage_data: dict[MetadataIndex, Entry] = {}

    def reset(self, checkpoint_id=None) -> None:
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def _files(self) -> list[str]:
        infos = self.store.fs.get_file_info(pafs.FileSelector(self.store.path, recursive=False))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(SAFETENSORS))

    def read_metadata(self, *args, **kwargs) -> Metadata:
        state: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, Entry] = {}
        for name in self._files():
            with self.store.fs.open_input_file(self.store.child(name).path) as f:
                header, data_start = read_header(self.store, name, f)
            self.bytes_read += data_start
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                shape, dtype = tuple(info["shape"]), DTYPES[info["dtype"]]
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
                if key in state:
                    raise _bad(self.store, name, f"tensor {key!r} is in another file of the checkpoint too")
                state[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [chunk])
                start = data_start + info["data_offsets"][0]
                storage[MetadataIndex(fqn=key, offset=[0] * len(shape))] = Entry(name, start, shape, dtype)
        self.storage_data = storage
        return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        buf = bytearray(BLOCK)
        pool = ThreadPoolExecutor(THREADS) if self.remote else None
        try:
            for name, items in per_file.items():
                with self.store.fs.open_input_file(self.store.child(name).path) as f:
                    for req in items:
                        target = planner.resolve_tensor(req).detach()
                        self.bytes_read += read_block(f, self.storage_data[req.storage_index], req, target, buf, pool)
                        planner.commit_tensor(req, target)
        finally:
            if pool is not None:
                pool.shutdown()
        fut: Future = Future()
        fut.set_result(None)
        return fut


def read_block(f, entry: Entry, req, target: torch.Tensor, buf: bytearray, pool=None) -> int:
    """Copy the block ``req`` asks for (``storage_offsets``/``lengths`` in the stored tensor)
    into ``target``, reading only its byte ranges; returns the bytes read."""
    dtype, shape = entry.dtype, list(entry.shape)
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    if not shape:  # a scalar
        shape, offsets, lengths, target = [1], [0], [1], target.reshape(1)
    if lengths[0] == 0 or target.numel() == 0:
        return 0
    itemsize = dtype.itemsize
    row = math.prod(shape[1:]) * itemsize  # bytes of one index along the first dim
    inner = math.prod(shape[2:]) * itemsize  # bytes of one index along the second
    full = [o == 0 and n == s for o, n, s in zip(offsets, lengths, shape, strict=True)]
    if len(shape) >= 2 and not full[1] and all(full[2:]):
        seg = lengths[1] * inner  # one contiguous segment per row
        if (row - seg) * HOLE_FRACTION > seg:
            first = entry.start + offsets[0] * row + offsets[1] * inner
            return _read_segments(f, first, row, seg, dtype, lengths, shape, target, buf, pool)
    rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:], strict=True))
    step = max(1, BLOCK // max(row, 1))
    view = memoryview(buf)
    for a in range(0, lengths[0], step):
        b = min(lengths[0], a + step)
        nbytes = (b - a) * row
        chunk = view[:nbytes] if nbytes <= len(buf) else memoryview(bytearray(nbytes))  # rows over 16 MiB
        f.seek(entry.start + (offsets[0] + a) * row)
        if f.readinto(chunk) != nbytes:
            raise OSError(f"{entry.file}: tensor {req.storage_index.fqn} ends early")
        block = torch.frombuffer(chunk, dtype=dtype, count=nbytes // itemsize).view(b - a, *shape[1:])
        target[a:b].copy_(block[(slice(None), *rest)])
    return lengths[0] * row


def _read_segments(f, first: int, row: int, seg: int, dtype, lengths, shape, target, buf, pool) -> int:
    """``lengths[0]`` rows of a column block: row ``r``'s ``seg`` bytes at ``first + r * row``."""
    step = max(1, BLOCK // seg)
    view = memoryview(buf)

    def fetch(r: int) -> bytes:
        data = f.read_at(seg, first + r * row)
        if len(data) != seg:
            raise OSError(f"{f}: a tensor ends early")
        return data

    for a in range(0, lengths[0], step):
        b = min(lengths[0], a + step)
        nbytes = (b - a) * seg
        chunk = view[:nbytes] if nbytes <= len(buf) else memoryview(bytearray(nbytes))
        parts = pool.map(fetch, range(a, b)) if pool is not None else map(fetch, range(a, b))
        for i, data in enumerate(parts):
            chunk[i * seg : (i + 1) * seg] = data
        block = torch.frombuffer(chunk, dtype=dtype, count=nbytes // dtype.itemsize)
        target[a:b].copy_(block.view(b - a, lengths[1], *shape[2:]))
    return lengths[0] * seg
