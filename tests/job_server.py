"""A Ray head's job server (its dashboard's REST API, the one `ray job submit` calls), asked from
the test process with the head's token. A `ray job status`, `logs`, `list` or `status` command
costs a Python start and Ray's import each (~2.5 s of CPU, over a minute once at load 150); these
calls cost next to nothing. Tests submit with `ray job submit` where the submission itself is
what they are about."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
