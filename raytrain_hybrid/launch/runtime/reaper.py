"""The processes of the private local Ray a driver starts end with the driver, however it ends.

``ray.init(address="local")`` makes the driver the parent of Ray's head processes (GCS, raylet,
dashboard, monitors), which the kernel ends with it even after ``kill -9`` (Ray sets a parent
death signal). Their own children do not: after a driver's SIGKILL the raylet's dashboard and
runtime-env agents lived on for minutes (they notice the raylet's death, then wait on the dead
GCS to report it), and a training worker for a few seconds.

So the driver that starts a local Ray also starts this small watcher (``start``): its own
process, in a session of its own (a Ctrl-C to the terminal does not reach it), reading a pipe
whose other end only the driver holds. While the driver lives, it notes the driver's
descendants now and then; when the pipe ends (the driver exited, or was killed), it ends those
that are still there, and their children, with SIGKILL (the driver is gone: nothing of its run
may go on, not even a save a worker had under way), then exits.
Nothing outside the driver's own descendants is touched: each process is held by psutil,
which checks its start time before signalling (a pid reused since is left alone).

Run as a file (``python reaper.py DRIVER_PID``), so it imports nothing of this package.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

_started: list = []  # the watcher of this process's local Ray (its pipe open while the driver lives)


def start() -> None:
    """Start this driver's watcher (once per process)."""
    if _started and _started[0].poll() is None:
        return
    watcher = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.PIPE,  # its write end stays here, not inherited (close-on-exec)
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _started[:] = [watcher]


def _descendants(procs) -> dict:
    import psutil

    found = {}
    for proc in procs:
        try:
            found[proc.pid] = proc
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    return found


def watch(driver_pid: int) -> None:
    import psutil

    me = os.getpid()
    try:
        driver = psutil.Process(driver_pid)
    except psutil.Error:
        return
    known: dict = {}
    wait = 0.25
    while True:
        known.update(_descendants([driver]))  # before each wait: the first as soon as this process is up
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], wait)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the pipe ended: the driver is gone
        if not driver.is_running():
            break
        wait = min(wait * 2, 5.0)  # Ray's processes start with it; later workers die with the raylet
    known.pop(driver_pid, None)
    known = _descendants(known.values())  # and what they started since the last look
    known.pop(me, None)
    for proc in known.values():
        try:
            proc.kill()  # (psutil checks the process is still the one noted: a reused pid is left alone)
        except psutil.Error:
            continue


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch(int(sys.argv[1]))
