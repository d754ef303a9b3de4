"""DCP's own metadata is a pickle: read it with an unpickler that admits only DCP's metadata
classes, torch sizes, dtypes and layouts, so a planted checkpoint cannot run code on load.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader


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


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the restricted unpickler for ``.metadata``."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
