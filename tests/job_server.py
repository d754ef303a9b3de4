"""A Ray head's job server (its dashboard's REST API, the one `ray job submit` calls), asked from
the test process with the head's token. A `ray job status`, `logs`, `list` or `status` command
costs a Python start and Ray's import each (~2.5 s of CPU, over a minute once at load 150); these
calls cost next to nothing. Tests submit with `ray job submit` where the submission itself is
what they are about."""

from __future__ import annotations

import json
import random
import socket
import threading
import urllib.error
import urllib.request

# Ports handed out by free_port, and from where. Not the kernel's ephemeral range (32768-60999 here):
# a port picked there by binding port 0 was free only at the pick, and Ray's processes bind their
# gRPC servers to port 0 while a head starts, so one of them could take a port picked for the head's
# dashboard before the dashboard bound it (CI: a dashboard that answered HTTP with gRPC's bytes,
# `http.client.BadStatusLine`). Nor Ray's worker ports (10002-19999, `--min/max-worker-port`).
# The range is the kernel's own where it says (another machine's may start lower than 32768).


def _below_ephemeral() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low - 20000 >= 1000:
        return range(20000, low)
    return range(high + 1, 65536)  # a kernel whose range starts low: above it, then


_PORTS = _below_ephemeral()
# Not the random module's shared generator: a test that seeds it would make every process of the
# suite (and a second suite on the machine) pick the same ports in the same order.
_RANDOM = random.SystemRandom()
_GIVEN: set[int] = set()
_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port free now, below the ephemeral range (nothing takes it by binding port 0)
    and not handed out before in this process (the suite's threads pick at once)."""
    with _LOCK:
        for _ in range(1000):
            port = _RANDOM.choice(_PORTS)
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {_PORTS}")


def answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (any status: the head may want its token)."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def call(address: str, token: str, path: str, body: dict | None = None, timeout: float = 300):
    """GET ``path`` (POST ``body`` as JSON) on the dashboard at ``address``; its JSON reply."""
    request = urllib.request.Request(
        f"{address}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def submitted(address: str, token: str, body: dict, timeout: float = 300) -> tuple[str, str]:
    """(submission id, "") once the job server has taken the job in ``body``, else ("", why): until
    the head's job agent has registered it refuses ("No available agent to submit job, please try
    again later"), and before that nothing listens."""
    try:
        return call(address, token, "/api/jobs/", body, timeout)["submission_id"], ""
    except urllib.error.HTTPError as exc:
        return "", f"{exc}: {exc.read().decode(errors='replace')}"
    except OSError as exc:  # a refused or timed-out connection
        return "", repr(exc)
