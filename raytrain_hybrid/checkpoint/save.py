"""Writing checkpoints, with the step loop blocked only for a copy of the state.

A save has two parts. The foreground part runs on every rank at a step boundary, and the step
loop waits for it: clear what a dead attempt at the same step left, a barrier, and a copy of
this rank's training state off the live tensors into CPU buffers (the next optimizer step
changes them). The background part runs in a thread while training goes on: DCP writes the
shards from that copy (``dcp.save``), each rank hashes (and on an object store uploads) its own
files, the digests are gathered, and rank 0 renames ``step_<N>.partial`` to
``step_<N>`` (a local disk or a mount) or writes ``manifest.json`` (an object store). That is
the last thing a save does, so a save that dies anywhere leaves the previous checkpoint the
newest complete one. ``checkpoint.async_save=false`` runs the same steps in the foreground.

Collectives: those of one process group must come in the same order on every rank, and a
background thread's interleave with the step's own (the training group, the mesh's groups) in
no fixed order. So the background part has a gloo group of its own, and the ranks agree that a
save is complete at a step boundary with a one-integer all-reduce on a second gloo group
(main thread only): every rank then reports it (to Ray Train) at the same step. A save still in
flight is waited for before the next one starts and at the end of the run.

A checkpoint commits only under the lease its run started under: rank 0 reads the driver's
lease on run.output_dir (launch.records.lease) when its writer is made and again before it completes a
save, and refuses to complete it once another run has taken the lease over (this run's driver
killed, or cut off from the storage): the other run may have chosen its checkpoint already.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_hybrid.checkpoint.manifest import FORMAT, MANIFEST, file_digest, layout_of
from raytrain_hybrid.checkpoint.state import training_state
from raytrain_hybrid.checkpoint.trajectory import describe
from raytrain_hybrid.storage import Store, open_store, private_dir


class CheckpointSaveError(RuntimeError):
    """A save failed (on some rank); its checkpoint is incomplete, the previous one stands."""


@dataclass
class Saved:
    """A complete checkpoint: ``timings`` has ``write_s`` (DCP's write of this rank's shards,
    from the save's start), ``save_s`` (to the manifest or rename) and ``blocked_s`` (the time
    the step loop spent on this save: the copy, the barrier, agreeing it is done, waiting)."""

    step: int
    path: Store
    timings: dict


@dataclass
class _InFlight:
    step: int
    path: Store
    future: Future  # of the timings; raises what failed on any rank
    blocked_s: float = 0.0


LEASE_FILE = "run.lease.json"  # launch.records.lease.LEASE, read here (this layer is below launch)
_UNKNOWN = object()  # no lease could be read: nothing to compare with


def lease_epoch(root: Store):
    """The token of the lease on ``root``'s run directory (``root`` is its checkpoints/), None
    when there is none (a run without a driver), _UNKNOWN when it cannot be read."""
    try:
        lease = root.parent.child(LEASE_FILE)
        if not lease.is_file():
            return None
        holder = json.loads(lease.read_bytes()).get("holder")
        return holder["token"] if isinstance(holder, dict) and isinstance(holder.get("token"), str) else _UNKNOWN
    except (OSError, ValueError, AttributeError):
        return _UNKNOWN


def lease_taken(root: Store, epoch) -> str | None:
    """Why a save of a run that started under lease ``epoch`` may not complete: another run holds
    run.output_dir's lease now. None when the lease is as it was or cannot be read."""
    now = lease_epoch(root)
    if epoch is _UNKNOWN or now is _UNKNOWN or now == epoch:
        return None
    return (
        f"another run took over the lease on {root.parent.uri} ({LEASE_FILE}) after this run started: "
        "this checkpoint is not completed, and this run stops writing there"
    )


class CheckpointWriter:
    """Saves the checkpoints of one run; every rank holds one and calls it at the same steps.

    ``save`` starts checkpoint ``step_<N>`` (finishing the one in flight first), ``poll`` at a
    step boundary returns the one in flight once every rank has finished it, ``close`` waits
    for it at the end. Each returns the checkpoints that became complete (none or one)."""

    def __init__(self, cfg, launch_id: str, trajectory: dict | None = None, data_origin: int = 0) -> None:
        self.cfg, self.launch_id, self.data_origin = cfg, launch_id, data_origin
        # What defines the run's trajectory (compared on resume): the driver's record, else this
        # rank 0's own (engine runs without a driver); only rank 0 writes the manifest.
        if trajectory is None and dist.get_rank() == 0:
            trajectory = describe(cfg)
        self.trajectory = trajectory or {}
        self.background = cfg.checkpoint.async_save
        self.root = open_store(cfg.run.output_dir).child("checkpoints")
        self.lease = lease_epoch(self.root) if dist.get_rank() == 0 else _UNKNOWN  # rank 0 completes saves
        self.inflight: _InFlight | None = None
        self.group = self.poll_group = None
        self.copy = _CpuCopy()
        if self.background:  # collective: every rank constructs its writer at the same point
            self.group = dist.new_group(backend="gloo")
            self.poll_group = dist.new_group(backend="gloo")

    def save(
        self, trainer, step: int, data_position: dict | None = None, steps: list[dict] | None = None
    ) -> list[Saved]:
        """Start checkpoint ``step_<step>``; returns the save that was in flight (waited for
        first) and, with checkpoint.async_save=false, this one too (done here). ``steps``: the
        metrics of the steps since the previous save (rank 0's, as metrics.jsonl has them)."""
        done = self.wait()
        t0 = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        final = self.root.child(f"step_{step}")
        staging = _staging_dir(self.root, self.launch_id, step, rank)
        if self.root.local:  # one staging directory beside the final one, made by rank 0
            if rank == 0:  # (through the store: a link planted at checkpoints/ is refused, not followed)
                self.root.child(f"step_{step}.partial").delete()  # an attempt that died
                self.root.child(f"step_{step}.partial").makedirs()
            dist.barrier()
        else:  # this rank's own directory on its node; an earlier attempt's objects go in the background
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        state, _ = training_state(trainer, rank, with_rng=True)
        manifest = {
            "format": FORMAT,
            "step": step,
            "launch_id": self.launch_id,
            "world_size": world,
            "layout": layout_of(self.cfg),
            "config": self.cfg.to_dict(),
            "data_position": data_position or {},
            "data_origin": self.data_origin,
            "trajectory": self.trajectory,
            # The workers write the checkpoint, the driver metrics.jsonl: a driver killed while its
            # workers go on never hears of the last steps. A resume takes their records from here.
            "steps": steps or [],
        }
        finish = _Finish(self.root, final, staging, rank, world, self.group, manifest, t0, self.lease)
        future: Future = Future()
        if not self.background:  # all of it here, on the default group: the step waits
            try:
                future.set_result(finish(state))
            except Exception as exc:
                future.set_exception(exc)
            self.inflight = _InFlight(step, final, future, time.perf_counter() - t0)
            return [*done, *self._collect()]
        staged = self.copy(state)
        del state

        def run() -> None:
            try:
                future.set_result(finish(staged))
            except BaseException as exc:  # handed to the step loop, which raises it
                future.set_exception(exc)

        # A daemon: a rank that fails elsewhere must not hang at exit on a peer that is gone.
        threading.Thread(target=run, name=f"checkpoint-step_{step}", daemon=True).start()
        self.inflight = _InFlight(step, final, future, time.perf_counter() - t0)
        return done

    def poll(self) -> list[Saved]:
        """The save in flight if it is finished on every rank (all ranks call this together)."""
        if self.inflight is None:
            return []
        t0 = time.perf_counter()
        flag = torch.tensor([int(self.inflight.future.done())])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.poll_group)
        self.inflight.blocked_s += time.perf_counter() - t0
        return self._collect() if flag.item() else []

    def wait(self) -> list[Saved]:
        """The save in flight, waited for."""
        if self.inflight is None:
            return []
        t0 = time.perf_counter()
        try:
            self.inflight.future.exception()  # waits; the error (if any) is raised by _collect
        finally:
            self.inflight.blocked_s += time.perf_counter() - t0
        return self._collect()

    def close(self) -> list[Saved]:
        """At the end of the run: nothing may be left in flight."""
        done = self.wait()
        self.copy.buffers.clear()
        return done

    def _collect(self) -> list[Saved]:
        inflight, self.inflight = self.inflight, None
        try:
            timings = inflight.future.result()
        except BaseException as exc:
            try:  # a rank failed after rank 0 had completed it (a peer lost at the very end)
                complete = inflight.path.child(MANIFEST).exists()
            except Exception:
                complete = False
            state = (
                "rank 0 completed it, and a restart resumes from it"
                if complete
                else "it is incomplete, the checkpoint before it is the newest complete one"
            )
            raise CheckpointSaveError(f"saving checkpoint {inflight.path} failed: {exc}; {state}") from exc
        return [Saved(inflight.step, inflight.path, {**timings, "blocked_s": inflight.blocked_s})]


class _CpuCopy:
    """This rank's training state copied into CPU buffers kept from save to save (no allocation
    each time; pinned when the tensors are on a GPU). Reusing them is safe: a save starts only
    once the previous one has finished. A DTensor keeps its spec (mesh, placements, global
    shape) around the copied local shard, so DCP writes it as it would the original."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, obj, key: str = ""):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, dict):
            return {k: self(v, f"{key}/{k}") for k, v in obj.items()}
        if isinstance(obj, DTensor):
            # The constructor, not DTensor.from_local: that would move the copy back to the mesh's device.
            return DTensor(self._copy(obj.to_local(), key), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._copy(obj, key)
        return obj

    def _copy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return buf.copy_(t)


@dataclass
class _Finish:
    """The part of a save after the copy: DCP writes the shards, this rank hashes (and uploads)
    its files, every rank's digests (or errors) are gathered, and rank 0 completes the checkpoint."""

    root: Store
    final: Store
    staging: Path
    rank: int
    world: int
    group: object  # the background's own gloo group; None (the default group) in the foreground
    manifest: dict
    t0: float
    lease: object = _UNKNOWN  # the lease the run started under (lease_epoch)

    def __call__(self, state: dict) -> dict:
        import torch.distributed.checkpoint as dcp

        if not self.root.local:
            self._clear_earlier_attempt()
        error, mine, write_s = None, {}, 0.0
        try:  # any rank's failure goes to every rank through the gather: none waits for a peer forever
            dcp.save(state, checkpoint_id=str(self.staging), process_group=self.group)  # DCP shares its errors
            write_s = time.perf_counter() - self.t0
            mine = {p.name: file_digest(p) for p in self.staging.iterdir() if p.name.startswith(f"__{self.rank}_")}
            if self.rank == 0:
                mine[".metadata"] = file_digest(self.staging / ".metadata")
            if not self.root.local:  # each rank uploads its own files: no rank reads another node's disk
                self.final.upload(str(self.staging))
                shutil.rmtree(self.staging, ignore_errors=True)
                with contextlib.suppress(OSError):  # still holds another rank's files: theirs to remove
                    self.staging.parent.rmdir()
        except Exception as exc:
            error = f"rank {self.rank}: {exc!r}"
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (error, mine), group=self.group)
        errors = [e for e, _ in parts if e]
        if errors:
            raise CheckpointSaveError("; ".join(errors))
        outcome = [None]
        if self.rank == 0:
            try:
                self._complete({name: d for _, part in parts for name, d in part.items()})
            except Exception as exc:
                outcome = [f"rank 0: {exc!r}"]
        dist.broadcast_object_list(outcome, src=0, group=self.group)  # every rank returns after it
        if outcome[0]:
            raise CheckpointSaveError(outcome[0])
        return {"write_s": write_s, "save_s": time.perf_counter() - self.t0}

    def _clear_earlier_attempt(self) -> None:
        """On object storage: rank 0 deletes what an earlier attempt of this run left at this
        step (a restart that saves the same step again) before any rank uploads; here, off the
        step's path (an HTTP listing, and deletes, per save). Every rank learns the outcome."""
        outcome = [None]
        if self.rank == 0:
            try:
                self.final.delete()
            except Exception as exc:
                outcome = [f"rank 0: {exc!r}"]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0]:
            raise CheckpointSaveError(outcome[0])

    def _complete(self, files: dict) -> None:
        if taken := lease_taken(self.root, self.lease):
            raise CheckpointSaveError(taken)
        text = json.dumps({**self.manifest, "files": files}, indent=1) + "\n"
        if self.root.local:
            # Durable before it counts: DCP fsyncs the shards and .metadata (sync_files); the
            # manifest and the directory entries are synced here, before and after the rename.
            with open(self.staging / MANIFEST, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(self.staging)
            self.final.delete()  # the same step of an earlier attempt of this run (after a restart)
            os.rename(self.staging, self.final.path)  # atomic: the directory appears complete or not at all
            _fsync_dir(Path(self.final.path).parent)
        else:
            self.final.child(MANIFEST).write_text(text)  # last: the checkpoint is complete from here on


def _fsync_dir(path: Path) -> None:
    """Make the names in a directory (new files, a rename) durable, as a file's fsync does its bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging_dir(root: Store, launch_id: str, step: int, rank: int) -> Path:
    """Where this rank's DCP files are written: in place beside the final directory on a local
    disk or a mount, else this node's private temp dir, one directory per run and rank (ranks on
    one node do not share it). Not per launch or step: a save that a kill cut short leaves its
    files there, and the next save of the run on this node (a restart's, a resume's) clears them
    before it writes, so a node keeps at most one save's staging per rank."""
    if root.local:
        return Path(root.path) / f"step_{step}.partial"
    run = hashlib.sha256(root.uri.encode()).hexdigest()[:16]
    return private_dir("ckpt", run) / f"rank{rank}"
