"""Where a run's bytes live: a local path, a shared mount, or an object-store URI.

The one place that turns what a user wrote (``runs/x``, ``/mnt/shared/x``, ``s3://bucket/x``,
``gs://bucket/x``) into a ``pyarrow.fs`` filesystem and a path on it. Endpoints and
credentials come from the standard environment, read by pyarrow itself (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, instance roles and IRSA for S3; application
default credentials for GCS): nothing here handles a key, so nothing here can leak one.

Object stores have no directories and no atomic rename; callers that need "complete or
absent" write a marker file last (the checkpoint manifest) instead of renaming.
"""

from __future__ import annotations

import os
import posixpath
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from raytrain_hybrid.config.coerce import refuse_credentials
from raytrain_hybrid.errors import ConfigError


def cache_dir() -> Path:
    """This machine's cache (the prepared builtin corpus, the calibrated profile):
    ``$RAYTRAIN_HYBRID_CACHE``, else ``~/.cache/raytrain_hybrid``; read when asked, not at import."""
    return Path(os.environ.get("RAYTRAIN_HYBRID_CACHE", "~/.cache/raytrain_hybrid")).expanduser()


def private_dir(*parts: str) -> Path:
    """A directory of this machine only this user can read or write, for caches and staging
    (tokenizer files, checkpoint shards on their way, pretrained copies, run mirrors):
    ``<tempdir>/raytrain-hybrid-<uid>/<parts>`` (tempdir: ``$TMPDIR``, else /tmp), the root made
    with mode 0700. A name another user could predict and plant first in a shared /tmp is
    checked: the root must be a real directory (not a link) this user owns that no one else
    can write, else it is refused, naming it. Made when asked, not at import."""
    root = Path(tempfile.gettempdir()) / f"raytrain-hybrid-{os.getuid()}"
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(root)
    why = ""
    if not stat.S_ISDIR(info.st_mode):
        why = "is not a directory (a link or a file someone put there)"
    elif info.st_uid != os.getuid():
        why = f"belongs to another user (uid {info.st_uid}), who could plant files this user's runs would read"
    elif info.st_mode & 0o022:
        why = f"can be written by other users (mode {stat.S_IMODE(info.st_mode):o}): they could plant files in it"
    if why:
        raise ConfigError("cache directory", str(root), f"{why}; remove it, or set TMPDIR to a directory of your own")
    if info.st_mode & 0o077:  # readable by others (a umask, or made before this check): make it private
        os.chmod(root, 0o700)
    path = root.joinpath(*parts)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def is_uri(location: str) -> bool:
    """``scheme://...`` (``file://`` included), as opposed to a plain local path."""
    return "://" in location


@dataclass(frozen=True)
class Store:
    """A directory on some filesystem: ``fs`` and ``path`` for pyarrow, ``uri`` to show and pass on."""

    fs: pafs.FileSystem
    path: str
    uri: str

    def __str__(self) -> str:
        return self.uri

    @property
    def local(self) -> bool:
        """On this machine's filesystem (a local disk or a mount), where rename is atomic."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def child(self, *parts: str) -> Store:
        return Store(self.fs, posixpath.join(self.path, *parts), "/".join([self.uri.rstrip("/"), *parts]))

    @property
    def parent(self) -> Store:
        return Store(self.fs, posixpath.dirname(self.path.rstrip("/")), self.uri.rstrip("/").rsplit("/", 1)[0])

    def _info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self._info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        # An object store shows a "directory" only while something lies under it.
        return self._info().type == pafs.FileType.Directory

    def size(self) -> int:
        return self._info().size

    def listdir(self) -> list[str]:
        """Names directly under this directory (none if it does not exist)."""
        if not self.is_dir():
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=False))
        return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)

    def makedirs(self) -> None:
        self.fs.create_dir(self.path, recursive=True)

    def open_input(self):
        """A binary stream of this file."""
        return self.fs.open_input_stream(self.path)

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """Whole or not at all: on a local disk through a rename, on an object store by the
        store's own semantics (an object appears only when its upload completes)."""
        if self.local:  # (through a new temporary file: a link planted at the name is replaced, not followed)
            from raytrain_hybrid.storage.nofollow import write_new

            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_new(self.path, data)
            return
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def delete(self) -> None:
        """This file or directory and everything under it; nothing if it is gone already."""
        info = self._info()
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path)

    def upload(self, local_dir: str) -> None:
        """Copy a local directory's files under this one (files of the same name are replaced)."""
        self.makedirs()
        pafs.copy_files(local_dir, self.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)

    def download(self, local_dir: str) -> None:
        """Copy everything under this directory into a local one."""
        os.makedirs(local_dir, exist_ok=True)
        pafs.copy_files(self.path, local_dir, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())


def as_store(location, key: str = "run.output_dir") -> Store:
    """A Store as it is; a path or URI (str or os.PathLike) opened."""
    return location if isinstance(location, Store) else open_store(os.fspath(location), key)


def open_store(location: str, key: str = "run.output_dir") -> Store:
    """The directory ``location`` names: a local path (made absolute: workers run elsewhere) or a
    URI pyarrow resolves. ``key`` names the setting in errors."""
    if not location:
        raise ConfigError(key, location, "is empty; give a directory or a URI such as s3://bucket/run")
    refuse_credentials(key, location)  # shown without them; nothing below sees them
    if not is_uri(location):
        path = os.path.abspath(os.path.expanduser(location))
        return Store(pafs.LocalFileSystem(), path, path)
    try:
        fs, path = pafs.FileSystem.from_uri(location)
    except (ValueError, OSError) as exc:  # pyarrow.ArrowInvalid is a ValueError
        raise ConfigError(
            key, location, f"is not a location pyarrow can open ({exc}); use a local path, s3://, gs:// or hdfs://"
        ) from exc
    uri = location.rstrip("/")
    if isinstance(fs, pafs.LocalFileSystem):  # file:///abs/path
        return Store(fs, path, path)
    return Store(fs, path.rstrip("/"), uri)
