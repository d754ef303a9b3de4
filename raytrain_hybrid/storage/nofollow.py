"""Writing a file on a local disk without following a link planted where it goes.

A run directory may be shared, or left by another run: a symlink named config.json that points
at ~/.bashrc must be replaced by the run's file, not make the run overwrite ~/.bashrc. A file is
written whole into a new temporary file beside it (created exclusively, O_NOFOLLOW) that then
replaces whatever the name held, a link included (a rename replaces the link, not its target);
a file written as it goes (metrics.jsonl) is created anew, the same way, with the old name
unlinked first.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def write_new(path: str | Path, data: bytes | str) -> None:
    """``path`` holds ``data``, written whole; whatever was there (a file, a link) is replaced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, _NEW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_new(path: str | Path, mode: str = "w"):
    """``path`` opened for writing as a new, empty file (``mode`` "w" or "wb"); a file or a link
    that was there is removed first, never followed."""
    path = Path(path)
    try:
        os.unlink(path)  # a link goes, its target stays as it was
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, _NEW, 0o644), mode)


def copy_new(source: str | Path, path: str | Path) -> None:
    """``source``'s bytes at ``path``, replacing whatever was there as ``write_new`` does."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(source, "rb") as src, os.fdopen(os.open(tmp, _NEW, 0o644), "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
