"""The driver's files of a run (metrics.jsonl, summary.json, config.json, driver.log, TensorBoard)
and where they end up: run.output_dir, on a local disk, a shared mount or object storage.

On a local path the driver writes there directly. For a URI it writes to a local mirror and
copies the mirror to the URI at every checkpoint and at the end, so a cluster that goes away
keeps what its run wrote (nothing lands in the working directory). driver.log is written
elsewhere until the run ends (a refused run must leave nothing behind): each sync copies it in
as it stands, so a driver that dies mid-run still leaves its log up to the last checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from raytrain_hybrid.storage import Store, open_store, private_dir
from raytrain_hybrid.storage.nofollow import copy_new, write_new


def mirror_dir(output_dir: str) -> Path:
    """Where the driver writes a run's files before they reach ``output_dir`` (itself when local).

    One per driver process and URI: two drivers on one machine writing the same URI (two jobs
    on a head node, or tests against two S3 servers with the same bucket name) must not share,
    and empty (RunDir.open fresh), each other's mirror. Under this user's private directory
    (storage.private_dir): the mirror holds the run's config and logs."""
    store = open_store(output_dir)
    if store.local:
        return Path(store.path)
    key = hashlib.sha256(f"{store.uri}\0{os.getpid()}".encode()).hexdigest()[:16]
    return private_dir("runs") / key


@dataclass(frozen=True)
class RunDir:
    store: Store
    local: Path

    @classmethod
    def open(cls, output_dir: str, fresh: bool = False) -> RunDir:
        """``fresh``: a run starting empties the mirror of a URI first; what an earlier run on this
        machine left there (another launch of the same URI) is in the URI already or not wanted."""
        store, local = open_store(output_dir), mirror_dir(output_dir)
        if fresh and not store.local:
            shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True, exist_ok=True)
        return cls(store, local)

    def sync(self, driver_log: Path | None = None) -> None:
        """Copy the mirror's files to the run's URI (nothing to do for a local run); first
        ``driver_log``, the driver's log being written (progress.quiet_driver), as driver.log."""
        if driver_log is not None and driver_log.exists():
            copy_new(driver_log, self.local / "driver.log")  # a link planted there is replaced, not followed
        if not self.store.local:
            self.store.upload(str(self.local))


def complete_records(cfg, point) -> dict:
    """A resume with nothing left to train (launch.runtime.start.check_resume's ``finished``: a driver
    killed as its workers completed the last step and its checkpoint): metrics.jsonl and
    summary.json of the whole run, from what it kept and the checkpoints' records; returns the
    summary. Nothing else there (driver.log, TensorBoard) is touched."""
    from raytrain_hybrid.launch.records.summary import summarize

    run_dir = RunDir.open(cfg.run.output_dir, fresh=True)  # (a URI's: only these two files are sent)
    write_new(run_dir.local / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in point.history))
    summary = {"ended": "completed", **summarize(cfg, point.history, []), "completed_from": point.path}
    write_new(run_dir.local / "summary.json", json.dumps(summary, indent=2) + "\n")
    run_dir.sync()
    return summary
