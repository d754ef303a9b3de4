"""Writing a file on a local disk without following a link planted where it goes.

A run directory may be shared, or left by another run: a symlink named config.json that points
at ~/.bashrc must be replaced by the run's file, not make the run overwrite ~/.bashrc. A file is
written whole into a new temporary file beside it (created exclusively, O_NOFOLLOW) that then
replaces whatever the name held, a link included (a rename replaces the link, not its target);
a file written as it goes (metrics.jsonl) is created anew, the same way, with the old name
unlinked first.

A link planted at a directory (``profile/`` pointing at another run's, ``checkpoints/`` at a
home directory) would carry every write, mkdir and delete under it to the link's target, so a
directory below the run directory is reached one component at a time, each opened with
O_NOFOLLOW relative to the one before (``open_below``): a link there is refused, naming it,
never followed. The run directory itself may be a link: where it points is the user's choice.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from pathlib import Path

from raytrain_hybrid.errors import ConfigError

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def write_new(path: str | Path, data: bytes | str, dir_fd: int | None = None) -> None:
    """``path`` holds ``data``, written whole; whatever was there (a file, a link) is replaced.
    ``dir_fd``: ``path`` is a name in that open directory (``open_below``'s)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, _NEW, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
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


def link_refused(path: str, root: str, key: str = "run.output_dir") -> ConfigError:
    """The error for a symbolic link found at ``path``, a directory below ``root`` (``key``'s)."""
    try:
        to = f" (to {os.readlink(path)})"
    except OSError:
        to = ""
    who = "the run does not" if key == "run.output_dir" else "nothing here does"
    return ConfigError(
        key,
        root,
        f"{path} is a symbolic link{to}, and {who} follow links inside its directory: "
        "remove the link (a real directory there is used)",
    )


def open_below(root: str, path: str, create: bool = False, key: str = "run.output_dir") -> int:
    """A descriptor of the directory ``path`` (``root`` or below it), reached from ``root`` one
    component at a time, each opened with O_NOFOLLOW relative to the one before, made first with
    ``create`` (``root`` too, through whatever it is): a link at a component is refused
    (``link_refused``), and a link swapped in after the look is not followed either, since no
    path is looked up again. FileNotFoundError when a component is missing and not ``create``."""
    rel = os.path.relpath(path, root)
    parts = [] if rel == "." else rel.split(os.sep)
    if parts[:1] == [os.pardir]:
        raise ValueError(f"{path} is not below {root}")
    if create:
        os.makedirs(root, exist_ok=True)
    fd = os.open(root, _DIR)
    try:
        for i, part in enumerate(parts):
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                below = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:  # ELOOP on Linux, ENOTDIR or EMLINK elsewhere, for a link
                if exc.errno != errno.ENOENT and stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                    raise link_refused(os.path.join(root, *parts[: i + 1]), root, key) from None
                raise
            os.close(fd)
            fd = below
        return fd
    except BaseException:
        os.close(fd)
        raise
