"""A block of one tensor entry of a DCP shard file, read by byte range.

DCP writes each tensor as a ``torch.save`` archive (an uncompressed zip: ``data.pkl``
describing the tensor, ``data/<key>`` its bytes) at a byte range of a shard file, and its
reader fetches that whole range, then narrows the tensor to the block a rank asked for. When a
checkpoint saved with whole tensors (ZeRO-1, dp replicas) is loaded under TP or FSDP, each
rank needs a part of each entry, and a node would fetch every entry once per rank that holds
a part of it (4x at (2,2,2) from (4,1,2)). Here, for a large entry of which a rank needs a
part, only these are read: the archive's directory (its last bytes), the description
(``data.pkl``: through torch's weights-only unpickler, the storage given as an empty one on
the meta device, so nothing of the data is read and nothing can run), one local header, and
then only the bytes of the needed rows (``checkpoint.hf_reader.read_block``).
"""

from __future__ import annotations

import io
import struct
import sys
import zipfile

import torch

from raytrain_hybrid.checkpoint.hf_reader import Entry

# Entries below this are read whole (a few small reads of the archive's structure cost more).
MIN_BYTES = 256 << 10
# A block of more than this share of an entry is read with the whole entry.
MAX_SHARE = 0.75
# A tensor's description (data.pkl) is a few hundred bytes; one this large is not read.
MAX_DESCRIPTION = 1 << 20
# Reading an archive's structure is many small reads (its end record, its directory, each
# record's local header, data.pkl, byteorder): 12 an entry, each a request on object storage
# (a checkpoint of 1,535 entries would take 18,000, one file's in turn). A small read that misses
# fetches a block this large around it (at the entry's end for the end record), which the reads
# after it mostly fall in: the archive's head and tail, 2-3 requests an entry (~4.6 KB).
BLOCK = 2 << 10


class _Window(io.RawIOBase):
    """Bytes ``offset .. offset + length`` of an open pyarrow file, read on demand, small reads
    a BLOCK at a time (kept: a read inside a block fetched before costs nothing)."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos, self.fetched = f, offset, length, 0, 0
        self.blocks: list[tuple[int, bytes]] = []  # (start in the entry, bytes)
        self.requests = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def _fetch(self, start: int, end: int) -> bytes:
        data = self.f.read_at(end - start, self.offset + start)
        self.fetched, self.requests = self.fetched + len(data), self.requests + 1
        return data

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        if n <= 0:
            return b""
        pos, end = self.pos, self.pos + n
        held = next(((lo, b) for lo, b in self.blocks if lo <= pos and end <= lo + len(b)), None)
        if held is None and n < BLOCK:
            lo = max(0, min(pos, self.length - BLOCK))
            held = (lo, self._fetch(lo, min(self.length, lo + BLOCK)))
            self.blocks.append(held)
        data = held[1][pos - held[0] : end - held[0]] if held is not None else self._fetch(pos, end)
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class NotRanged(ValueError):
    """The entry is not a plain contiguous tensor archive: read it whole (DCP's own way)."""


def _description(zf: zipfile.ZipFile):
    """A tensor archive's ``data.pkl`` through torch's weights-only unpickler, its storages given
    as empty ones on the meta device (nothing of the data is read, nothing can run): the tensor it
    describes, its storages (key, dtype, elements), the records' prefix and the byte order."""
    names = zf.namelist()
    pickles = [n for n in names if n.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise NotRanged(f"{len(pickles)} data.pkl records")
    described = zf.getinfo(pickles[0])
    if described.compress_type != zipfile.ZIP_STORED or described.file_size > MAX_DESCRIPTION:
        raise NotRanged("a compressed or outsized data.pkl")  # (torch.save stores a few hundred bytes)
    prefix = pickles[0][: -len("data.pkl")]
    order = zf.read(f"{prefix}byteorder").decode() if f"{prefix}byteorder" in names else "little"
    storages: list[tuple[str, torch.dtype, int]] = []

    def meta_storage(saved_id):
        kind, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise NotRanged(f"a persistent id {kind!r}")
        storages.append((str(key), dtype, int(numel)))
        empty = torch.UntypedStorage(int(numel) * dtype.itemsize, device="meta")
        return torch.storage.TypedStorage(wrap_storage=empty, dtype=dtype, _internal=True)

    from torch import _weights_only_unpickler

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(zf.read(pickles[0])), encoding="utf-8")
    unpickler.persistent_load = meta_storage
    try:
        tensor = unpickler.load()
    except Exception as exc:  # refused or unreadable here: DCP's reader refuses it the same way
        raise NotRanged(f"data.pkl: {exc}") from None
    return tensor, storages, prefix, order


def check_entry(f, offset: int, length: int, sizes: torch.Size, dtype: torch.dtype) -> None:
    """That the entry at ``offset`` (``length`` bytes) of an open shard file is a tensor archive
    describing one tensor of ``sizes`` and ``dtype`` (the checkpoint's metadata for its chunk)
    whose bytes lie in the archive, read as data: its directory and ``data.pkl`` only, never its
    tensor bytes. NotRanged says what else it is (a pickle of anything but a tensor, a garbled
    archive, another shape)."""
    window = _Window(f, offset, length)
    try:
        with zipfile.ZipFile(window) as zf:
            tensor, storages, prefix, _ = _description(zf)
            if not isinstance(tensor, torch.Tensor) or len(storages) != 1:
                raise NotRanged(f"describes a {type(tensor).__name__} over {len(storages)} storages, not one tensor")
            if tensor.shape != sizes or tensor.dtype != dtype:
                raise NotRanged(f"describes a {tensor.dtype} tensor of {list(tensor.shape)}")
            key, stored, numel = storages[0]
            strides = zip(tensor.shape, tensor.stride(), strict=True)
            reach = tensor.storage_offset() + sum((d - 1) * s for d, s in strides if d)
            if tensor.numel() and reach >= numel:
                raise NotRanged(f"describes a tensor reaching element {reach} of a storage of {numel}")
            if zf.getinfo(f"{prefix}data/{key}").file_size != numel * stored.itemsize:
                raise NotRanged("holds fewer bytes than its storage")
    except (zipfile.BadZipFile, KeyError, struct.error, EOFError, ValueError) as exc:
        if isinstance(exc, NotRanged):
            raise
        raise NotRanged(f"is not a tensor archive ({exc})") from None


def entries_problem(store, md) -> str | None:
    """What in a checkpoint's shards is not the tensor its (checked) metadata describes, or None:
    every entry's archive read as data by ``check_entry`` (a few small reads each, on the driver,
    before any worker starts), so that a pickle of anything but a tensor planted in a shard, or an
    entry of another shape or dtype, is refused with the file named rather than in a worker."""
    chunks = {
        (fqn, tuple(c.offsets)): (c.sizes, entry.properties.dtype)
        for fqn, entry in md.state_dict_metadata.items()
        for c in entry.chunks
    }
    by_file: dict[str, list] = {}
    for index, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))

    def one_file(name: str) -> str | None:
        with store.fs.open_input_file(store.child(name).path) as f:
            for index, info in sorted(by_file[name], key=lambda item: item[1].offset):
                chunk = chunks.get((index.fqn, tuple(index.offset or ())))
                if chunk is None:
                    at = list(index.offset or ())
                    return f"{name} holds a chunk of {index.fqn!r} at {at} that the metadata does not list"
                try:
                    check_entry(f, info.offset, info.length, *chunk)
                except NotRanged as exc:
                    shape = f"{chunk[1]} tensor of {list(chunk[0])}"
                    why = str(exc)[:300]
                    return f"{name} holds {index.fqn!r} as something other than the {shape} the metadata says: {why}"
        return None

    names = sorted(by_file)
    if store.local:
        problems = map(one_file, names)
    else:  # object storage: a few round trips an entry, files read side by side
        from concurrent.futures import ThreadPoolExecutor

        from raytrain_hybrid.checkpoint.hf_reader import THREADS

        with ThreadPoolExecutor(THREADS) as pool:
            problems = list(pool.map(one_file, names))
    return next((p for p in problems if p), None)


def describe(f, name: str, offset: int, length: int, sizes: torch.Size) -> tuple[Entry, int]:
    """Where the data of the tensor entry at ``offset`` (``length`` bytes) lies in the file, as
    an hf_reader Entry, and the bytes read to find out. ``sizes``: the chunk's shape in the
    checkpoint's metadata, which the archive must describe."""
    window = _Window(f, offset, length)
    try:
        with zipfile.ZipFile(window) as zf:
            tensor, storages, prefix, order = _description(zf)
            ok = isinstance(tensor, torch.Tensor) and len(storages) == 1 and order == sys.byteorder
            ok = ok and tensor.shape == sizes and tensor.is_contiguous() and tensor.storage_offset() == 0
            if not ok:
                raise NotRanged("not one contiguous tensor of the chunk's shape")
            key, dtype, numel = storages[0]
            info = zf.getinfo(f"{prefix}data/{key}")
            nbytes = tensor.numel() * dtype.itemsize
            if (
                info.compress_type != zipfile.ZIP_STORED
                or info.file_size != numel * dtype.itemsize
                or numel < tensor.numel()
            ):
                raise NotRanged("a compressed or short storage record")
            window.seek(info.header_offset)
            header = window.read(30)
            start = info.header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
            if header[:4] != b"PK\x03\x04" or start + nbytes > length:
                raise NotRanged("a storage record outside the entry")
    except (zipfile.BadZipFile, KeyError, struct.error, EOFError) as exc:
        raise NotRanged(str(exc)) from None
    return Entry(name, offset + start, tuple(sizes), dtype), window.fetched
