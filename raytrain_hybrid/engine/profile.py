"""run.profile_steps: torch.profiler over chosen steps on every rank, written into the run directory.

Every rank traces the same steps [first, last] (counted from 1, as the progress line counts them)
and writes its Chrome/Perfetto trace through the storage layer to
``run.output_dir/profile/trace_rank<R>.json``: the traces of every node land in the one run
directory (a bucket, a shared mount), as checkpoints do. Each step is a ``step <N>`` span. The
step before ``first``, when this launch runs it, is the profiler's warm-up, so its start-up cost
stays out of the trace. On CUDA the same steps' allocations are recorded
(``torch.cuda.memory._record_memory_history``) and dumped after ``last`` as
``memory_rank<R>.pickle`` (for https://pytorch.org/memory_viz), with ``memory_rank<R>.json``
beside it: the rank's place in the layout, its measured peak and the planner's prediction (given
by the launch layer, which may ask the planner; the engine may not).
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile

import torch
import torch.distributed as dist

from raytrain_hybrid.config import Config
from raytrain_hybrid.storage import Store, open_store, private_dir

PROFILE_DIR = "profile"
MEMORY_ENTRIES = 100_000  # allocation events kept by the memory history (TorchTitan's default)


class StepProfiler:
    """Hooks for the step loop: ``before(step)`` and ``after(step)`` around each step (0-based
    indices), ``close()`` when the loop ends (a window the data cut short is written as it stands)."""

    def __init__(self, cfg: Config, trainer, start: int, predicted: dict | None):
        first, last = cfg.run.profile_steps
        self.first, self.last = first - 1, last - 1  # 0-based step indices
        self.begin = max(start, self.first - 1)  # the warm-up step, when this launch runs it
        self.rank, self.device, self.predicted = dist.get_rank(), trainer.device, predicted
        coords = {"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": trainer.mesh.tp.get_local_rank()}
        self.about = {"rank": self.rank, **coords, "profile_steps": [first, last]}
        self.store: Store = open_store(cfg.run.output_dir).child(PROFILE_DIR)
        self.prof = None
        self.span = None
        self.recording_memory = False

    @classmethod
    def open(cls, cfg: Config, trainer, start: int, predicted: dict | None = None) -> StepProfiler | None:
        """For the loop that starts at step index ``start``: None when run.profile_steps is empty,
        or the loop starts after its last step (a resume)."""
        if not cfg.run.profile_steps or start > cfg.run.profile_steps[1] - 1:
            return None
        return cls(cfg, trainer, start, predicted)

    def before(self, step: int) -> None:
        if step == self.begin:
            self._start()
        if self.prof is None:
            return
        if step == max(self.begin, self.first) and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
            self.recording_memory = True
        self.span = torch.profiler.record_function(f"step {step + 1}")
        self.span.__enter__()

    def after(self, step: int) -> None:
        if self.prof is None:
            return
        self.span.__exit__(None, None, None)
        self.span = None
        self.prof.step()
        if step == self.last:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()  # exports the trace (_write_trace) unless the schedule already did
        if self.recording_memory:
            self._write_memory()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = max(0, self.first - self.begin)
        active = self.last - max(self.begin, self.first) + 1
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.written = False
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write_trace,
            record_shapes=True,
        )
        self.prof.start()

    def _write_trace(self, prof) -> None:
        if self.written:
            return
        self.written = True
        fd, local = tempfile.mkstemp(suffix=".json", dir=private_dir("profile"))
        os.close(fd)
        try:
            prof.export_chrome_trace(local)
            with open(local, "rb") as f:
                self.store.child(f"trace_rank{self.rank}.json").write_bytes(f.read())
        finally:
            os.unlink(local)

    def _write_memory(self) -> None:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording_memory = False
        self.store.child(f"memory_rank{self.rank}.pickle").write_bytes(pickle.dumps(snapshot))
        measured = {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
        }
        beside = {**self.about, "measured": measured, "predicted_fullest_rank": self.predicted}
        self.store.child(f"memory_rank{self.rank}.json").write_text(json.dumps(beside, indent=2) + "\n")
