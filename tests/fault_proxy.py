"""An S3 endpoint that can die: a TCP proxy in front of the S3 server on loopback (tests/s3_server.py).

Runs go through it; a fault (tests/fault_injection.py, target ``s3``) kills it with SIGKILL, which
resets the connections open through it mid-request, and ``keep_up`` restarts it on the same port.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

from job_server import free_port


class Proxy:
    """A TCP proxy in front of the S3 server, the endpoint the runs use: killed with SIGKILL (open
    connections reset mid-request), it is restarted on the same port ``down_s`` seconds later.
    The objects live on behind it, as they do on S3 when its front end restarts (moto keeps
    them in its memory, so moto itself is not the process killed)."""

    def __init__(self, target_port: int, down_s: float = 1.0) -> None:
        self.target, self.down_s = target_port, down_s
        self.port = free_port()  # (below the ephemeral range: the proxy's restarts rebind it)
        self.proc: subprocess.Popen | None = None
        self.restarts, self.died_at = 0, None
        self.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [sys.executable, __file__, "proxy", str(self.port), str(self.target)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, start_new_session=True)
        self.proc.stdout.readline()  # "listening"

    def keep_up(self) -> None:
        """Restart it once it has been down ``down_s`` seconds (call often)."""
        if self.proc.poll() is None:
            return
        self.died_at = self.died_at or time.monotonic()
        if time.monotonic() - self.died_at >= self.down_s:
            self.start()
            self.restarts, self.died_at = self.restarts + 1, None

    def wait_up(self, limit: float = 30.0) -> None:
        """Until it is back (after a fault that killed it)."""
        deadline = time.monotonic() + limit
        while self.proc.poll() is not None and time.monotonic() < deadline:
            self.keep_up()
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve_proxy(port: int, target: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    print("listening", flush=True)
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", target))
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


if __name__ == "__main__" and sys.argv[1:2] == ["proxy"]:
    _serve_proxy(int(sys.argv[2]), int(sys.argv[3]))
