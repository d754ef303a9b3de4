"""A real S3 HTTP endpoint on loopback (moto's server), for tests that write to object storage.

Clients find it the standard way: ``AWS_ENDPOINT_URL`` plus dummy keys in the environment,
which pyarrow (and so Ray Train's storage) reads itself; nothing in the package is told.
One server serves the whole session; the session's Ray starts with its environment exported
(tests/conftest.py), so CLI runs that write to the bucket can join that cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time
import urllib.request

from job_server import free_port

# Dummy credentials: moto accepts any; they must never show up in what a run writes.
KEY_ID, SECRET = "AKIATESTRAYTRAINHYB", "test-secret-do-not-leak-0123456789"


_SESSION: dict = {}  # the one server of this test session: {"proc": Popen, "env": {...}}
_LOCK = threading.Lock()  # the tests' thread and the background jobs' (tests/background.py) ask at once


def session_env() -> dict[str, str]:
    """The environment of this test session's S3 server, started on first use (one moto process
    for the whole suite instead of one per test module; stopped when the session ends)."""
    with _LOCK:
        if not _SESSION:
            _start()
    return dict(_SESSION["env"])


def _start() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-role lookups on this machine
    }
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=1)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.2)
    atexit.register(_stop, proc)
    _SESSION.update(proc=proc, env=env)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _fresh_buckets(env: dict[str, str], buckets) -> None:
    """Each user of the shared server starts from empty buckets, as from a server of its own:
    every object version gone (a test may have turned versioning on), the bucket made anew."""
    import boto3

    client = boto3.session.Session().client(  # a session of its own: boto3's default one is not thread-safe
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    for bucket in buckets:
        if bucket in existing:
            for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
                for v in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
                    client.delete_object(Bucket=bucket, Key=v["Key"], VersionId=v["VersionId"])
            client.delete_bucket(Bucket=bucket)
        client.create_bucket(Bucket=bucket)


def fresh_buckets(*buckets: str) -> dict[str, str]:
    """The session's server with ``buckets`` empty; its environment (not exported), for a
    subprocess. A test that runs beside others (tests/background.py) uses buckets of its own."""
    env = session_env()
    _fresh_buckets(env, buckets)
    return env


@contextlib.contextmanager
def s3_server(buckets=("bucket",)):
    """The session's server with ``buckets`` empty, its environment exported; yield the environment."""
    env = fresh_buckets(*buckets)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
