"""Reading a checkpoint as data: nothing in a checkpoint directory can run code on load.

A checkpoint lives where others may write (a shared bucket, a mount), so its files are
untrusted input on the driver and on every worker:

- DCP's ``.metadata`` is a pickle. It is read by an unpickler that admits an exact list of
  (module, name) pairs: DCP's metadata classes, ``torch.Size``, dtypes, the layout helper, a
  path class. Never a prefix, never a dotted name (pickle protocol 4 resolves
  ``os.system`` inside any module that imports ``os``).
- The metadata it yields is then checked as a structure: every entry a tensor (this project
  saves tensors only; DCP's default planner would ``torch.load(weights_only=False)`` a
  "bytes" entry), every shard reference a file name of DCP's own pattern inside the
  checkpoint, no storage transforms.
- Loads go through a planner whose ``load_bytes`` refuses, so even a reader bug cannot reach
  the unpickling path; tensors themselves are read by DCP with ``torch.load(weights_only=True)``.

Reads go straight to where the checkpoint is (a local disk, a mount or object storage through
``pyarrow.fs``): each rank opens only the shard files its plan names and reads only the byte
ranges of the entries it loads, so no node copies a whole checkpoint. Of a large entry a rank
needs only part of (a checkpoint of whole tensors loaded under TP or FSDP), only that part's
rows are read (``checkpoint.entry_ranges``). The metadata is fetched once per reader.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.futures import Future

from raytrain_hybrid.checkpoint import entry_ranges
from raytrain_hybrid.checkpoint.hf_reader import BLOCK, THREADS, read_block
from raytrain_hybrid.storage import Store, as_store

METADATA = ".metadata"
# DCP's shard files: __<rank>_<n>.distcp, directly in the checkpoint directory.
SHARD_NAME = re.compile(r"^__\d+_\d+\.distcp$")

_DCP = "torch.distributed.checkpoint"
_DTYPES = {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
# Exactly what a DCP metadata pickle of tensors refers to (torch 2.13), and nothing else.
ALLOWED = {
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
} | {("torch", n) for n in _DTYPES}


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds something a checkpoint of this project never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if (module, name) not in ALLOWED:  # exact pairs: "a.b" as a name is never in the set
            raise UnsafeCheckpoint(f"refers to {module}.{name}, which a checkpoint never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnsafeCheckpoint("uses pickle persistent ids, which a checkpoint's metadata never holds")


def _layout(name: str):
    """torch.strided and friends, by name (how tensor properties pickle their layout)."""
    layout = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise UnsafeCheckpoint(f"names an unknown tensor layout {name!r}")
    return layout


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise UnsafeCheckpoint(what)


def check_metadata(md: object) -> Metadata:
    """The metadata of a checkpoint of tensors, or UnsafeCheckpoint saying what is wrong."""
    _require(type(md) is Metadata, f"is a {type(md).__name__}, not DCP metadata")
    _require(isinstance(md.state_dict_metadata, dict), "has no table of entries")
    for key, entry in md.state_dict_metadata.items():
        _require(isinstance(key, str), f"has an entry named by a {type(key).__name__}")
        _require(
            type(entry) is TensorStorageMetadata,
            f"marks {key!r} as a {type(entry).__name__}: this trainer saves tensors only (and never unpickles a "
            "checkpoint's data)",
        )
        _require(type(entry.properties) is TensorProperties, f"has no tensor properties for {key!r}")
        _require(isinstance(entry.properties.dtype, torch.dtype), f"has no dtype for {key!r}")
        _require(type(entry.size) is torch.Size, f"has no size for {key!r}")
        for chunk in entry.chunks:
            _require(type(chunk) is ChunkStorageMetadata, f"has a malformed chunk of {key!r}")
    _require(isinstance(md.storage_data, dict), "has no table of shard locations")
    for index, info in md.storage_data.items():
        _require(type(index) is MetadataIndex and isinstance(index.fqn, str), "has a malformed shard index")
        _require(index.fqn in md.state_dict_metadata, f"locates {index.fqn!r}, which it does not list")
        _require(type(info) is _StorageInfo, f"has a malformed location for {index.fqn!r}")
        _require(
            isinstance(info.relative_path, str) and bool(SHARD_NAME.match(info.relative_path)),
            f"points {index.fqn!r} at {info.relative_path!r}, not a shard file of the checkpoint (__<r>_<n>.distcp)",
        )
        _require(
            type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0,
            f"has a malformed byte range for {index.fqn!r}",
        )
        _require(not info.transform_descriptors, f"asks for storage transforms on {index.fqn!r}")
    planner = md.planner_data
    _require(
        planner is None
        or (
            isinstance(planner, dict)
            and all(
                isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
                for k, v in planner.items()
            )
        ),
        "has malformed planner data",
    )
    _require(md.storage_meta is None or type(md.storage_meta) is StorageMeta, "has malformed storage data")
    return md


def parse_metadata(data: bytes) -> Metadata:
    """A ``.metadata`` file's bytes as checked DCP metadata (UnsafeCheckpoint otherwise)."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # a truncated or garbled pickle: data, not code, so just unreadable
        raise UnsafeCheckpoint(f"is not readable DCP metadata ({type(exc).__name__}: {exc})") from None
    return check_metadata(md)


class _ArrowFileSystem(FileSystemBase):
    """DCP's file interface over a ``pyarrow.fs`` filesystem (local, mount, S3, GCS), for
    reading: files open for random access, so a read of an entry fetches its byte range only."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self.fs = fs

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise io.UnsupportedOperation("this checkpoint reader only reads")
        with self.fs.open_input_file(str(path)) as f:
            yield f

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return str(path)

    def rename(self, path, new_path) -> None:
        raise io.UnsupportedOperation("this checkpoint reader only reads")

    def mkdir(self, path) -> None:
        raise io.UnsupportedOperation("this checkpoint reader only reads")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    def rm_file(self, path) -> None:
        raise io.UnsupportedOperation("this checkpoint reader only reads")

    def ls(self, path) -> list[str]:
        return [i.path for i in self.fs.get_file_info(pafs.FileSelector(str(path)))]


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader for a checkpoint directory on any storage (a path, a URI or a Store):
    metadata through the restricted unpickler and the structure check; each entry read as one
    byte range of its shard file. ``bytes_read`` counts what this reader fetched."""

    def __init__(self, path) -> None:
        store: Store = as_store(path, "--resume")
        super().__init__(store.path)
        self.fs = _ArrowFileSystem(store.fs)
        self.path = store.path
        self.store = store
        self.bytes_read = 0
        self._metadata_bytes: bytes | None = None  # fetched once, checked at every parse
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata_bytes is None:
            self._metadata_bytes = self.store.child(METADATA).read_bytes()
            self.bytes_read += len(self._metadata_bytes)
        data = self._metadata_bytes
        try:
            metadata = parse_metadata(data)
        except UnsafeCheckpoint as exc:
            raise UnsafeCheckpoint(f"{self.store.child(METADATA)} {exc}") from None
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {
            (fqn, tuple(c.offsets)): (c.sizes, entry.properties.dtype)
            for fqn, entry in metadata.state_dict_metadata.items()
            for c in entry.chunks
        }

    def read_data(self, plan: LoadPlan, planner) -> Future:
        """DCP's reads, except that of a large entry a rank needs a part of, only the part is read."""
        whole, partial = [], {}
        for req in plan.items:
            sinfo = self.storage_data[req.storage_index]
            chunk = self._chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
            share = math.prod(req.lengths) * chunk[1].itemsize / max(sinfo.length, 1) if chunk else 1.0
            if (
                req.type == LoadItemType.TENSOR
                and sinfo.length >= entry_ranges.MIN_BYTES
                and share <= entry_ranges.MAX_SHARE
            ):
                partial.setdefault(sinfo.relative_path, []).append((req, chunk[0]))
            else:
                whole.append(req)
        if partial:
            whole += self._read_parts(partial, planner)
        return super().read_data(dataclasses.replace(plan, items=whole), planner)

    def _read_parts(self, partial: dict, planner) -> list:
        """Read each request's rows of its entry; returns those to read whole after all."""
        rest, buf = [], bytearray(BLOCK)
        pool = None if self.store.local else ThreadPoolExecutor(THREADS)
        try:
            for relative_path, items in partial.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as f:
                    for req, sizes in items:
                        sinfo = self.storage_data[req.storage_index]
                        try:
                            entry, fetched = entry_ranges.describe(f, relative_path, sinfo.offset, sinfo.length, sizes)
                        except entry_ranges.NotRanged:
                            rest.append(req)
                            continue
                        target = planner.resolve_tensor(req).detach()
                        self.bytes_read += fetched + read_block(f, entry, req, target, buf, pool)
                        planner.commit_tensor(req, target)
        finally:
            if pool is not None:
                pool.shutdown()
        return rest

    def _slice_file(self, file, sinfo: _StorageInfo):
        # One read of the entry's range (torch.load then seeks within memory, not on storage).
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length:
            raise UnsafeCheckpoint(f"a shard of {self.store} ends inside an entry it lists (truncated?)")
        self.bytes_read += len(data)
        return io.BytesIO(data)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner without its unpickling path: a bytes entry is refused."""

    def load_bytes(self, read_item, value) -> None:
        raise UnsafeCheckpoint(
            f"the checkpoint holds {read_item.dest_index.fqn!r} as pickled bytes; this trainer saves tensors only "
            "and never unpickles a checkpoint's data"
        )


def safe_load(state: dict, path, *, process_group=None, no_dist: bool = False) -> SafeFileSystemReader:
    """``dcp.load`` of ``state`` from a checkpoint directory, through the safe reader and
    planner; returns the reader (its ``bytes_read``)."""
    import torch.distributed.checkpoint as dcp

    reader = SafeFileSystemReader(path)
    reader.read_metadata()  # first, so that a refusal is raised as itself, not inside DCP's collective error
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group, no_dist=no_dist)
    return reader


def shard_files(path) -> list[str]:
    """The shard files a checkpoint's metadata names (checked metadata)."""
    store = as_store(path, "--resume")
    md = parse_metadata(store.child(METADATA).read_bytes())
    return sorted({info.relative_path for info in md.storage_data.values()})


__all__ = [
    "ALLOWED",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpoint",
    "check_metadata",
    "parse_metadata",
    "safe_load",
    "shard_files",
]
