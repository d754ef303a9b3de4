"""A real S3 HTTP endpoint on loopback (moto's server), for tests that write to object storage.

Clients find it the standard way: ``AWS_ENDPOINT_URL`` plus dummy keys in the environment,
which pyarrow (and so Ray Train's storage) reads itself; nothing in the package is told.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

# Dummy credentials: moto accepts any; they must never show up in what a run writes.
KEY_ID, SECRET = "AKIATESTRAYTRAINHYB", "test-secret-do-not-leak-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(buckets=("bucket",)):
    """Start the server, export its environment, create ``buckets``; yield the environment."""
    port = _free_port()
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
    saved = {k: os.environ.get(k) for k in env}
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=1)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)
        os.environ.update(env)
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], allow_bucket_creation=True)
        for bucket in buckets:
            fs.create_dir(bucket)
        yield env
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        proc.terminate()
        proc.wait(timeout=10)
