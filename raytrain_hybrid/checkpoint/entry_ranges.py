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


class _Window(io.RawIOBase):
    """Bytes ``offset .. offset + length`` of an open pyarrow file, read on demand."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos, self.fetched = f, offset, length, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        data = self.f.read_at(n, self.offset + self.pos) if n > 0 else b""
        self.pos += len(data)
        self.fetched += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class NotRanged(ValueError):
    """The entry is not a plain contiguous tensor archive: read it whole (DCP's own way)."""


def describe(f, name: str, offset: int, length: int, sizes: torch.Size) -> tuple[Entry, int]:
    """Where the data of the tensor entry at ``offset`` (``length`` bytes) lies in the file, as
    an hf_reader Entry, and the bytes read to find out. ``sizes``: the chunk's shape in the
    checkpoint's metadata, which the archive must describe."""
    window = _Window(f, offset, length)
    try:
        with zipfile.ZipFile(window) as zf:
            names = zf.namelist()
            pickles = [n for n in names if n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise NotRanged(f"{len(pickles)} data.pkl records")
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
