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
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
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
    """A directory on some filesystem: ``fs`` and ``path`` for pyarrow, ``uri`` to show and pass on.

    ``root``: the directory the user named (``open_store``'s path; its children keep it), and
    ``key`` the setting that named it. On a local disk, what is written, made or deleted below
    ``root`` never passes through a link at a directory between them (storage.nofollow.open_below):
    a link planted at ``profile/`` or ``checkpoints/`` is refused, naming it, not followed."""

    fs: pafs.FileSystem
    path: str
    uri: str
    root: str = field(default="", compare=False)
    key: str = field(default="run.output_dir", compare=False)

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
        path = posixpath.join(self.path, *parts)
        return Store(self.fs, path, "/".join([self.uri.rstrip("/"), *parts]), self.root or self.path, self.key)

    @property
    def parent(self) -> Store:
        path = posixpath.dirname(self.path.rstrip("/"))
        root = self.root if _below(path, self.root) else path  # (above the root: the parent is one)
        return Store(self.fs, path, self.uri.rstrip("/").rsplit("/", 1)[0], root, self.key)

    def _dir_fd(self, path: str, create: bool) -> int:
        """Local directory ``path`` (this store's or its parent) opened from the root without
        following a link below it; a store opened at a file (``as_store(run/"x.json")``) has
        its own directory as the root."""
        from raytrain_hybrid.storage.nofollow import open_below

        root = self.root if _below(path, self.root) else path
        return open_below(root, path, create, self.key)

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
        if self.local:
            os.close(self._dir_fd(self.path, create=True))
            return
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

            fd = self._dir_fd(os.path.dirname(self.path), create=True)
            try:
                write_new(os.path.basename(self.path), data, dir_fd=fd)
            finally:
                os.close(fd)
            return
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def delete(self) -> None:
        """This file or directory and everything under it; nothing if it is gone already.
        On a local disk a link at it, or at a directory above it below the root, is refused."""
        if self.local and self.path != self.root:
            self._delete_local()
            return
        info = self._info()
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path)

    def _delete_local(self) -> None:
        from raytrain_hybrid.storage.nofollow import link_refused

        try:
            fd = self._dir_fd(os.path.dirname(self.path), create=False)
        except FileNotFoundError:
            return
        name = os.path.basename(self.path)
        try:  # relative to the directory opened: nothing is looked up through a link again
            mode = os.lstat(name, dir_fd=fd).st_mode
            if stat.S_ISLNK(mode):  # (a planted step_<N>: pruning it must not reach its target)
                raise link_refused(self.path, self.root or self.path, self.key)
            if stat.S_ISDIR(mode):
                shutil.rmtree(name, dir_fd=fd)  # fd-based: a link inside is removed, not followed
            else:
                os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def upload(self, local_dir: str) -> None:
        """Copy a local directory's files under this one (files of the same name are replaced)."""
        self.makedirs()
        if self.local:  # each directory it goes into first made or looked at without following a link
            for below, _, _ in os.walk(local_dir):
                rel = os.path.relpath(below, local_dir)
                os.close(self._dir_fd(os.path.normpath(os.path.join(self.path, rel)), create=True))
        pafs.copy_files(local_dir, self.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)

    def download(self, local_dir: str) -> None:
        """Copy everything under this directory into a local one."""
        os.makedirs(local_dir, exist_ok=True)
        pafs.copy_files(self.path, local_dir, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())


def _below(path: str, root: str) -> bool:
    """``path`` is ``root`` or under it (both absolute, normalized)."""
    return bool(root) and (path == root or path.startswith(root.rstrip("/") + "/"))


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
        return Store(pafs.LocalFileSystem(), path, path, path, key)
    try:
        fs, path = pafs.FileSystem.from_uri(location)
    except (ValueError, OSError) as exc:  # pyarrow.ArrowInvalid is a ValueError
        raise ConfigError(
            key, location, f"is not a location pyarrow can open ({exc}); use a local path, s3://, gs:// or hdfs://"
        ) from exc
    uri = location.rstrip("/")
    if isinstance(fs, pafs.LocalFileSystem):  # file:///abs/path
        return Store(fs, path, path, path, key)
    return Store(fs, path.rstrip("/"), uri, path.rstrip("/"), key)
