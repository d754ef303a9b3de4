"""One fault-injection trial: a run with a fault, the restart a user makes, and what is checked.

Shared by benchmarks/bench_faults.py (the campaign) and tests/test_faults.py (its sample). The run
trains a tiny Llama for STEPS steps on WORLD gloo ranks (dp=2, ZeRO-1: each rank's shard holds
its own optimizer slice), a checkpoint after every step. A fault (tests/fault_injection.py) fires
in one save; then the run restarts as ``train --resume <run dir>`` does, or, when the fault came
before any checkpoint was complete, as ``train`` does, and trains to the end. Checked: every loss
after the restart equals the uninterrupted run's; every checkpoint that was complete when the
fault fired (rank 0 logs it as the rename or the manifest's upload returns) is intact after the
fault and at the end (sizes, SHA-256, metadata); the user's files are unchanged.
"""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

import fault_injection as fi

STEPS, WORLD = 5, 2
CONFIG = [f"train.steps={STEPS}", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
          "model.seq_len=32", "train.global_batch_size=4", "parallelism.dp=2", "parallelism.tp=1",
          "parallelism.pp=1", "parallelism.microbatches=1", "parallelism.zero=1",
          "checkpoint.interval=1"]  # fmt: skip
# Where faults fire, with their weights: points every rank passes, and rank 0's alone.
POINTS = {
    "local": {
        "random": 5,
        "dcp_write": 2,
        "dcp_metadata": 1,
        "hash": 1,
        "fsync_dir": 2,
        "rename": 1,
        "after_rename": 1,
    },  # fmt: skip
    "s3": {
        "random": 4,
        "dcp_write": 1,
        "dcp_metadata": 1,
        "hash": 1,
        "upload": 2,
        "manifest": 1,
        "after_manifest": 1,
        "s3_restart": 3,
    },  # fmt: skip
}
RANK0_ONLY = {"dcp_metadata", "fsync_dir", "rename", "after_rename", "manifest", "after_manifest"}
TOLERANCE = 1e-6  # relative, per step's loss


def overrides(out: str, sync: bool = False, steps: int = STEPS) -> list[str]:
    return [*CONFIG, f"train.steps={steps}", f"run.output_dir={out}", f"checkpoint.async_save={str(not sync).lower()}"]


def sample_fault(rng: random.Random, kind: str, calib: dict, points: dict | None = None, steps=STEPS) -> dict:
    """A fault drawn from ``points`` (POINTS[kind]), its step, rank, target and timing."""
    points = points or POINTS[kind]
    point = rng.choices(list(points), weights=list(points.values()))[0]
    rank = 0 if point in RANK0_ONLY else rng.randrange(WORLD)
    fault = {"point": point, "step": rng.randint(1, steps), "rank": rank, "target": rng.choice(["worker", "driver"])}
    save_s = calib["save_s"]  # (a save's time varies with the machine's load: the ranges allow for it)
    if point == "random":  # from the start of the save's background part to a little past its end
        fault.update(share=round(rng.uniform(0, 1.2), 3), delay=round(rng.uniform(0, 1.2 * save_s), 3))
    elif point == "upload":
        fault["delay"] = round(rng.uniform(0, max(0.3, save_s / 2)), 3)
    elif point == "s3_restart":
        fault.update(point="upload", target="s3", delay=round(rng.uniform(0, max(0.4, 0.6 * save_s)), 3),
                     down_s=round(rng.uniform(0.5, 4.0), 2))  # fmt: skip
    elif point == "dcp_write":
        fault["nth"] = rng.randint(1, calib["items"][rank])
    elif point == "hash":
        fault["nth"] = rng.randint(1, 2 if rank == 0 else 1)
    elif point == "fsync_dir":
        fault["nth"] = rng.randint(1, 2)  # 1: manifest written and synced, not renamed; 2: renamed
    return fault


def digest(store) -> str:
    return hashlib.sha256(store.read_bytes()).hexdigest()


def intact(store) -> bool:
    """A complete checkpoint, checked as the driver checks one before a resume (SHA-256 included)."""
    from raytrain_hybrid.checkpoint.manifest import verify
    from raytrain_hybrid.errors import ConfigError

    try:
        verify(store, digests=True)
    except (ConfigError, OSError, ValueError):
        return False
    return True


def run_dir(kind: str, trial: Path, bucket: str = "faults") -> str:
    return f"s3://{bucket}/{trial.name}/run" if kind == "s3" else str(trial / "run")


def reference(ctx, kind: str, trial: Path, env: dict, proxy=None, steps: int = STEPS) -> dict:
    """The uninterrupted run: its losses, and what faults are drawn from (tensors a rank writes, a save's seconds)."""
    from raytrain_hybrid.checkpoint.reader import parse_metadata
    from raytrain_hybrid.storage import open_store

    trial.mkdir(parents=True, exist_ok=True)
    out = run_dir(kind, trial)
    r = fi.run(ctx, overrides(out, steps=steps), WORLD, str(trial), env=env, proxy=proxy)
    assert r["status"] == "ok", r
    md = parse_metadata(open_store(out).child("checkpoints", f"step_{steps}", ".metadata").read_bytes())
    items = [sum(1 for i in md.storage_data.values() if i.relative_path == f"__{n}_0.distcp") for n in range(WORLD)]
    saves = sorted(s["save_s"] for s in r["saves"])
    return {"losses": dict(r["history"]), "items": items, "save_s": saves[len(saves) // 2], "save_s_all": saves}


def trial(ctx, kind: str, trial: Path, fault: dict, calib: dict, env: dict, *, proxy=None, sync=False,
          steps: int = STEPS) -> dict:  # fmt: skip
    """Run with ``fault``, restart, check; a row of what happened (see the module's docstring)."""
    from raytrain_hybrid.storage import open_store

    trial.mkdir(parents=True, exist_ok=True)
    out = run_dir(kind, trial)
    if proxy is not None:
        proxy.down_s = fault.get("down_s", 1.0)
    args = overrides(out, sync, steps)
    # The user's files: one in the run directory, one beside it (and with S3 a local one too).
    users = [open_store(out).child("NOTES.md"), open_store(out).parent.child("elsewhere", "keep.txt")]
    if kind == "s3":
        users.append(open_store(str(trial / "local_keep.txt")))
    for n, f in enumerate(users):
        f.write_text(f"the user's file {n} of {trial.name}\n")
    before = [digest(f) for f in users]
    t0 = time.time()
    first = fi.run(ctx, args, WORLD, str(trial), fault=fault, env=env, proxy=proxy)
    if proxy is not None:
        proxy.wait_up()
    log = fi.events(str(trial))
    fired = [e for e in log if e["event"] == "fault"]
    fired_t = fired[0]["t"] if fired else float("inf")
    complete = sorted({e["step"] for e in log if e["event"] == "complete" and e["t"] < fired_t})
    ckpts = open_store(out).child("checkpoints")
    lost_at_fault = [n for n in complete if not intact(ckpts.child(f"step_{n}"))]
    row = {"trial": trial.name, "fault": fault, "async_save": not sync, "fired": bool(fired),
           "fired_in": {k: fired[0][k] for k in ("phase", "at_step")} if fired else None,
           "first_run": first["status"], "complete_when_fired": complete}  # fmt: skip
    if first["status"] != "ok" and first.get("error"):
        row["first_error"] = first["error"].splitlines()[0][:300]
    launches = [first.get("launch_id")]
    losses, row["restart"] = dict(first.get("history", [])), None
    if first["status"] != "ok":
        second = fi.run(ctx, args, WORLD, str(trial), resume=out, env=env, proxy=proxy)
        row["restart"] = "resume"
        if second["status"] == "refused" and (
            "no intact checkpoint" in second["error"] or "holds no checkpoints" in second["error"]
        ):
            row["restart"], row["resume_refused"] = "fresh", second["error"][:300]  # nothing to resume: train again
            second = fi.run(ctx, args, WORLD, str(trial), env=env, proxy=proxy)
        if second["status"] == "nothing_left":
            row["restart"] = "none_left"  # the fault came after the last step's checkpoint was complete
        row["second_run"] = second["status"]
        if second["status"] != "ok":
            row["second_error"] = second.get("error", "")[:600]
        if second.get("resumed_from"):
            row["resumed_from_step"] = int(second["resumed_from"].rstrip("/").rsplit("_", 1)[1])
        losses = dict(second.get("history", []))
        launches.append(second.get("launch_id"))
    start = row.get("resumed_from_step", 0)
    want = {s: v for s, v in calib["losses"].items() if s >= start}
    diffs = [abs(losses[s] - v) / abs(v) for s, v in want.items() if s in losses]
    row["losses_equal"] = len(diffs) == len(want) and max(diffs, default=0.0) <= TOLERANCE
    if row["restart"] == "none_left":
        row["losses_equal"] = None  # no step left to compare (the killed run's steps are not reported)
    row["max_rel_diff"] = max(diffs, default=None)
    row["resumed_from_newest_complete"] = (
        start >= max(complete, default=0) if row.get("second_run") in ("ok", "nothing_left") else None
    )
    lost_at_end = [n for n in complete if not intact(ckpts.child(f"step_{n}"))]
    row["checkpoints_lost"] = sorted(set(lost_at_fault) | set(lost_at_end))
    row["final_checkpoint_intact"] = intact(ckpts.child(f"step_{steps}"))
    row["user_files_changed"] = sum(1 for f, d in zip(users, before, strict=True) if not f.exists() or digest(f) != d)
    if row["checkpoints_lost"] or row["losses_equal"] is False:  # what the run directory holds, for a look
        row["listing"] = _listing(ckpts)
    row["wall_s"] = round(time.time() - t0, 1)
    row["staging_left_bytes"] = _clear_staging(launches)
    return row


def _listing(store) -> dict:
    import pyarrow.fs as pafs

    try:
        infos = store.fs.get_file_info(pafs.FileSelector(store.path, recursive=True))
    except OSError as exc:
        return {"error": repr(exc)}
    root = store.path.rstrip("/") + "/"
    return {i.path.removeprefix(root): i.size for i in infos if i.type == pafs.FileType.File}


def _clear_staging(launches: list) -> int:
    """Delete the local staging that saves to object storage left behind, and say its bytes (this
    trial's launches only: the directory is shared with every other run of this user here)."""
    import shutil

    from raytrain_hybrid.storage import private_dir

    left = 0
    for launch_id in filter(None, launches):
        root = private_dir("ckpt") / launch_id
        left += sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
        shutil.rmtree(root, ignore_errors=True)
    return left
