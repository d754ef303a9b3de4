"""Hang diagnostics: which ranks did not arrive at the collective the others wait in.

torch's flight recorder (on for gloo and NCCL in torch 2.13, 2000 entries; ``TORCH_FR_BUFFER_SIZE``
or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` sets how many, 0 turns it off) keeps each rank's last
collectives: per process group, a sequence number, the op, its sizes, whether it completed. A
:class:`HangWatch` thread on every rank notices a step that has run longer than its timeout and
writes the rank's record to ``hang/fr_rank<R>.json`` in the run directory (through the storage
layer: every node's ranks into one place); rank 0 then reads those it finds and writes
``hang/report.json`` with, per process group, the newest collective some rank entered and the
ranks whose records stop before it: the ones that did not arrive (a rank stuck elsewhere, or one
whose record is missing: its process is gone or frozen). No collective is used to find out: the
group may be the one that hangs.

On NCCL, torch's process groups also dump their own record when a collective times out
(``TORCH_NCCL_DUMP_ON_TIMEOUT``, written by the watchdog before it ends the process): those files
go to a directory on the node's local disk (:func:`nccl_env`, set before the process group is
made) and are copied to ``hang/nccl/`` in the run directory by the watch thread, or by the next
start of a worker on that node when the process was gone first (:func:`gather_nccl_dumps`)."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import tempfile
import threading
import time

from raytrain_hybrid.storage import Store, open_store

HANG_DIR = "hang"
NCCL_DUMPS = "nccl"  # hang/nccl/: torch's own NCCL flight-recorder dumps, one file a rank
SETTLE_S = 2.0  # a dump unchanged this long is whole
FR_ENTRIES = "2000"  # entries of the flight recorder a rank keeps (torch's default)
# Where torch writes a dump: this prefix followed by the rank (the first name is torch 2.13's, the
# second the older one it still reads).
DUMP_PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
log = logging.getLogger(__name__)


def nccl_dump_prefix(output_dir: str) -> str:
    """The local path prefix of this run's NCCL dumps on a node (one directory a run)."""
    run = hashlib.sha1(output_dir.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "raytrain_hybrid_nccl", run, "nccl_trace_rank_")


def nccl_env(cfg) -> dict[str, str]:
    """With run.hang_timeout_s: what a rank's NCCL process groups need, before they are made, to keep
    a flight record and dump it when a collective times out (to :func:`nccl_dump_prefix`)."""
    if not cfg.run.hang_timeout_s:
        return {}
    prefix = nccl_dump_prefix(cfg.run.output_dir)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": FR_ENTRIES,
        "TORCH_FR_BUFFER_SIZE": FR_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        **dict.fromkeys(DUMP_PREFIX_VARS, prefix),
    }


def set_env(env: dict[str, str]) -> None:
    """Set ``env`` in this process, keeping what the user set; the dump directory made."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
    for key in DUMP_PREFIX_VARS:
        if key in env:
            os.makedirs(os.path.dirname(os.environ[key]), exist_ok=True)


def ray_hang_detector_env(cfg, backend: str) -> dict[str, str]:
    """With run.hang_timeout_s on an NCCL run: Ray Train's NCCL hang detector (it polls NCCL's RAS
    monitor and, on a communicator stalled for the timeout, saves every rank's stack and the RAS
    report under checkpoints/hang_detector/ of the run directory; it observes, never ends the run)."""
    if not cfg.run.hang_timeout_s or "nccl" not in backend:
        return {}
    return {
        "RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR": "1",
        "RAY_TRAIN_NCCL_RAS_CONFIRM_DURATION_S": str(float(cfg.run.hang_timeout_s)),
    }


def gather_nccl_dumps(store: Store) -> list[str]:
    """Copy the NCCL dumps on this node (where this process's variables say torch writes them) to
    ``store``/nccl/, deleting the local copies; the names copied. A file changed in the last
    ``SETTLE_S`` may still be being written: the next look takes it."""
    prefix = next((os.environ[k] for k in DUMP_PREFIX_VARS if os.environ.get(k)), "")
    copied = []
    for path in sorted(glob.glob(glob.escape(prefix) + "*")) if prefix else []:
        try:
            if time.time() - os.path.getmtime(path) < SETTLE_S:
                continue
            with open(path, "rb") as f:
                data = f.read()
            store.child(NCCL_DUMPS, os.path.basename(path)).write_bytes(data)
            os.unlink(path)
            copied.append(os.path.basename(path))
        except FileNotFoundError:  # another rank of this node took it first
            continue
        except OSError as exc:  # a dump still being written, or gone: the next look takes it
            log.warning("could not copy the NCCL dump %s: %s", path, exc)
    return copied


def start(cfg) -> HangWatch | None:
    """run.hang_timeout_s: the flight recorder on (torch's default, unless the environment turned
    it off) and this rank's watch thread; None when off."""
    import torch.distributed as dist

    if not cfg.run.hang_timeout_s:
        return None
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_ENTRIES)
    rank, world = dist.get_rank(), dist.get_world_size()
    store = open_store(cfg.run.output_dir).child(HANG_DIR)
    gather_nccl_dumps(store)  # left on this node by a process that timed out before a restart
    return HangWatch(store, rank, world, cfg.run.hang_timeout_s)


def flight_record() -> dict:
    """This rank's flight-recorder entries (empty when the recorder is off): gloo's, and on a CUDA
    build NCCL's, which torch keeps in a recorder of its own."""
    import torch._C._distributed_c10d as c10d

    record = json.loads(c10d._dump_fr_trace_json(True, True))
    if hasattr(c10d, "_dump_nccl_trace_json"):
        nccl = json.loads(c10d._dump_nccl_trace_json(True, True))
        record.setdefault("entries", []).extend(nccl.get("entries", []))
        record.setdefault("pg_config", {}).update(nccl.get("pg_config", {}))
    return record


def not_arrived(records: dict[int, dict], world: int) -> list[dict]:
    """Per process group: the newest collective any rank entered, and the ranks that did not."""
    newest: dict[str, dict] = {}  # process group name -> the entry with the highest sequence number
    reached: dict[str, dict[int, int]] = {}  # process group name -> rank -> its highest sequence number
    members: dict[str, list[int]] = {}
    for rank, record in records.items():
        for name, config in record.get("pg_config", {}).items():
            members.setdefault(name, json.loads(config.get("ranks", "[]")))
        for entry in record.get("entries", []):
            if entry.get("is_p2p"):
                continue
            name, seq = entry["process_group"][0], entry["collective_seq_id"]
            reached.setdefault(name, {})[rank] = max(reached.get(name, {}).get(rank, 0), seq)
            if seq > newest.get(name, {}).get("collective_seq_id", 0):
                newest[name] = entry
    report = []
    for name, entry in newest.items():
        seq = entry["collective_seq_id"]
        pg_id, pg_name = entry["process_group"]
        # The default group spans the world; another one, the ranks whose records show it (torch
        # 2.13's records leave the members of a group out).
        ranks = members.get(pg_name) or members.get(pg_id)
        if not ranks:
            ranks = list(range(world)) if pg_name == "default_pg" else sorted(reached[name])
        behind = sorted(r for r in ranks if reached[name].get(r, 0) < seq)
        if behind:
            report.append(
                {
                    "process_group": pg_name or pg_id,
                    "collective": entry["profiling_name"],
                    "seq": seq,
                    "sizes": entry.get("input_sizes"),
                    "arrived": sorted(r for r in ranks if r not in behind),
                    "not_arrived": behind,
                    "no_record": sorted(r for r in behind if r not in records),
                }
            )
    return report


def describe(report: list[dict], step: int) -> str:
    if not report:
        return f"step {step} ran past the hang timeout; every rank reached the same collectives"
    return "; ".join(
        f"step {step} hangs in {r['collective']} #{r['seq']} of {r['process_group']}: "
        f"ranks {r['not_arrived']} did not arrive (ranks {r['arrived']} wait in it)"
        for r in report
    )


class HangWatch:
    """A daemon thread per rank: when a step runs past ``timeout_s``, dump this rank's record;
    rank 0 waits ``gather_s`` for the others' and writes the report (once per step)."""

    def __init__(self, store: Store, rank: int, world: int, timeout_s: float, gather_s: float = 5.0) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s, self.gather_s = timeout_s, gather_s
        self.step: int | None = None
        self.started = 0.0
        self.reported: set[int] = set()
        self.report: list[dict] | None = None  # rank 0's last report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raytrain-hang-watch", daemon=True)
        self._thread.start()

    def begin(self, step: int) -> None:
        self.step, self.started = step, time.monotonic()

    def end(self) -> None:
        self.step = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if self.reported:  # after a hang: NCCL's own dump, should its timeout come too
                gather_nccl_dumps(self.store)
            step = self.step
            if step is None or step in self.reported or time.monotonic() - self.started < self.timeout_s:
                continue
            self.reported.add(step)
            try:
                self._dump(step)
            except Exception as exc:  # noqa: BLE001 - a diagnostic must not end the run
                log.warning("hang diagnostics of step %s failed: %s", step, exc)

    def _dump(self, step: int) -> None:
        self.store.child(f"fr_rank{self.rank}.json").write_text(json.dumps(flight_record()))
        if self.rank != 0:
            return
        deadline = time.monotonic() + self.gather_s
        records: dict[int, dict] = {}
        while time.monotonic() < deadline and len(records) < self.world:
            for r in range(self.world):
                f = self.store.child(f"fr_rank{r}.json")
                if r not in records and f.exists():
                    records[r] = json.loads(f.read_text())
            time.sleep(0.2)
        self.report = not_arrived(records, self.world)
        said = describe(self.report, step + 1)
        self.store.child("report.json").write_text(
            json.dumps({"step": step + 1, "said": said, "collectives": self.report}, indent=2) + "\n"
        )
        log.error("%s (flight records in %s)", said, self.store)
