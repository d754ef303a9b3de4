"""One run per output directory: an exclusive lease taken when a run starts.

Two runs on one run.output_dir (a resubmitted job, a copied command) would prune each other's
checkpoints and overwrite each other's metrics. The driver takes ``run.lease.json`` in the
directory before any worker starts, renews it while the run goes on, and deletes it at the end.
A second run finds it and is refused, naming the holder (host, process, start, job).

Taking it is atomic on each kind of storage: on a local disk or a mount, under an ``flock`` on
a lock file beside it (the read, the decision and the write are one step); on S3, a conditional
put (``If-None-Match: *`` to create, ``If-Match: <etag>`` to renew or to take over an expired
one), which S3 guarantees. Other object stores (GCS, HDFS) get a write and a read back: best
effort, said when it is taken.

A holder that died stops renewing: its lease expires ``ttl_s`` after the last renewal (at once
when it ran on this host and its process is gone), so ``--resume`` of a crashed run needs no
manual step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.storage import Store, open_store

LEASE = "run.lease.json"
TTL_S = 120.0  # a lease not renewed for this long is its dead holder's
RENEW_S = TTL_S / 4


class LeaseLost(RuntimeError):
    """Another run took this run's lease (it was not renewed in time): stop writing."""


def _holder(job: str = "") -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "job": job or os.environ.get("RAY_JOB_SUBMISSION_ID") or os.environ.get("RAY_JOB_ID", ""),
        "token": uuid.uuid4().hex,
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def expired(lease: dict, now: float | None = None) -> bool:
    """Whether a lease's holder is gone: not renewed within its ttl, or a dead process here."""
    now = time.time() if now is None else now
    try:
        if now - float(lease["renewed_at"]) > float(lease.get("ttl_s", TTL_S)):
            return True
        holder = lease["holder"]
        return holder["host"] == socket.gethostname() and not _alive(int(holder["pid"]))
    except (KeyError, TypeError, ValueError):
        return True  # unreadable: no run can be shown to hold it


def describe(lease: dict, now: float | None = None) -> str:
    holder = lease.get("holder", {}) if isinstance(lease, dict) else {}
    age = (time.time() if now is None else now) - float(lease.get("renewed_at", 0) or 0)
    job = f", job {holder['job']}" if holder.get("job") else ""
    return (
        f"host {holder.get('host', '?')}, process {holder.get('pid', '?')}, started {holder.get('started_at', '?')}"
        f"{job}; renewed {age:.0f} s ago"
    )


class _Backend:
    """Read, create-if-absent and replace-if-unchanged of the lease object."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def read(self) -> tuple[dict | None, str | None]:
        raise NotImplementedError

    def create(self, body: dict) -> bool:
        raise NotImplementedError

    def replace(self, body: dict, version: str | None) -> bool:
        raise NotImplementedError

    def delete(self, version: str | None) -> None:
        raise NotImplementedError


def _parse(data: bytes) -> dict:
    try:
        lease = json.loads(data)
    except ValueError:
        return {}
    return lease if isinstance(lease, dict) else {}


class _LocalBackend(_Backend):
    """A local disk or a mount: each operation under an flock of the run directory itself
    (no lock file is left behind)."""

    @contextlib.contextmanager
    def _locked(self):
        import fcntl

        os.makedirs(self.store.parent.path, exist_ok=True)
        fd = os.open(self.store.parent.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def read(self):
        try:
            with open(self.store.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, None
        lease = _parse(data)
        return lease, lease.get("holder", {}).get("token") if lease else ""

    def _write(self, body: dict) -> None:
        tmp = f"{self.store.path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.store.path)

    def create(self, body):
        with self._locked():
            if os.path.exists(self.store.path):
                return False
            self._write(body)
            return True

    def replace(self, body, version):
        with self._locked():
            if self.read()[1] != version:
                return False
            self._write(body)
            return True

    def delete(self, version):
        with self._locked():
            if self.read()[1] == version:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.store.path)


class _S3Backend(_Backend):
    """S3's conditional writes: If-None-Match: * creates, If-Match: <etag> replaces."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        import boto3

        # A session of its own: boto3's default one is not thread-safe (the renewal runs in a thread).
        self.client = boto3.session.Session().client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)
        self.bucket, _, self.key = store.path.partition("/")

    def _failed(self, exc) -> bool:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")

    def read(self):
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None, None
        return _parse(got["Body"].read()), got["ETag"]

    def _put(self, body: dict, **condition) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=json.dumps(body).encode(), **condition)
        except ClientError as exc:
            if self._failed(exc):
                return False
            raise
        return True

    def create(self, body):
        return self._put(body, IfNoneMatch="*")

    def replace(self, body, version):
        return self._put(body, IfMatch=version)

    def delete(self, version):
        lease, etag = self.read()
        if etag == version:
            self.client.delete_object(Bucket=self.bucket, Key=self.key)


class _BestEffortBackend(_LocalBackend):
    """Object stores without conditional writes through pyarrow: a write, then a read back."""

    @contextlib.contextmanager
    def _locked(self):
        yield

    def read(self):
        if not self.store.is_file():
            return None, None
        lease = _parse(self.store.read_bytes())
        return lease, lease.get("holder", {}).get("token") if lease else ""

    def _write(self, body):
        self.store.write_text(json.dumps(body))

    def create(self, body):
        if self.store.is_file():
            return False
        self._write(body)
        return self.read()[1] == body["holder"]["token"]

    def delete(self, version):
        if self.read()[1] == version:
            self.store.delete()


def _backend(store: Store) -> _Backend:
    if store.local:
        return _LocalBackend(store)
    if store.uri.startswith("s3://"):
        return _S3Backend(store)
    return _BestEffortBackend(store)


@dataclasses.dataclass
class Lease:
    """The lease this driver holds on run.output_dir; renewed in a thread until ``release``."""

    store: Store
    body: dict
    backend: _Backend
    lost: str = ""
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def token(self) -> str:
        return self.body["holder"]["token"]

    def _ours(self) -> tuple[bool, dict | None, str | None]:
        current, version = self.backend.read()
        return bool(current) and current.get("holder", {}).get("token") == self.token, current, version

    def renew(self) -> bool:
        """Renew it; False (and ``lost`` says who has it) when another run took it over."""
        ours, current, version = self._ours()
        body = {**self.body, "renewed_at": time.time()}
        if not ours or not self.backend.replace(body, version):
            self.lost = _taken_by(current)
            return False
        self.body = body
        return True

    def held(self) -> bool:
        """Whether this run still holds it, looked at now (False, and ``lost`` says who has it,
        once another run took it over; True when it cannot be read: no claim)."""
        try:
            ours, current, _ = self._ours()
        except Exception:  # storage briefly unreachable
            return not self.lost
        if not ours:
            self.lost = _taken_by(current)
        return ours

    def start_renewing(self, every_s: float = RENEW_S) -> None:
        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    if not self.renew():
                        return
                except Exception:  # storage briefly unreachable: try again at the next renewal
                    continue

        self._thread = threading.Thread(target=loop, name="run-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):  # a lease left behind expires by itself
            ours, _, version = self._ours()
            if ours:
                self.backend.delete(version)


def _taken_by(current: dict | None) -> str:
    """Who holds a lease that is no longer this run's (for the lost run's error)."""
    return describe(current) if current else f"{LEASE} was removed"


def in_use(uri: str, current: dict, ttl_s: float = TTL_S) -> ConfigError:
    """The refusal of a run whose output directory ``uri`` another run (``current``) holds: `train`'s,
    and `check`'s, which reads the lease without taking it."""
    return ConfigError(
        "run.output_dir",
        uri,
        f"is in use by another run ({describe(current)}); two runs on one directory would delete each "
        f"other's checkpoints. Wait for it to end, or choose another run.output_dir (a crashed run's lease "
        f"expires {ttl_s:.0f} s after its last renewal)",
    )


def acquire(output_dir: str, job: str = "", ttl_s: float = TTL_S) -> Lease:
    """The lease of ``output_dir`` for this driver, or a ConfigError naming the run holding it."""
    store = open_store(output_dir).child(LEASE)
    backend = _backend(store)
    body = {"holder": _holder(job), "renewed_at": time.time(), "ttl_s": ttl_s}
    if backend.create(body):
        return Lease(store, body, backend)
    current, version = backend.read()
    if current is not None and not expired(current):
        raise in_use(store.parent.uri, current, ttl_s)
    # Its holder is gone: take it over, unless another driver was quicker.
    if (current is None and backend.create(body)) or (current is not None and backend.replace(body, version)):
        return Lease(store, body, backend)
    raise ConfigError("run.output_dir", store.parent.uri, "another run took it over just now; choose another one")
