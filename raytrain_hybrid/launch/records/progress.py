"""What the driver shows and records while a run goes on.

Rank 0's per-step metrics arrive through a Ray queue (launch.runtime.driver); here they become
a live progress bar (a terminal), one line per step (a log, e.g. a `ray job submit`
driver), ``metrics.jsonl`` and TensorBoard event files in the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from raytrain_hybrid.errors import redact
from raytrain_hybrid.launch.records.events import (
    CheckpointEvent,
    DoneEvent,
    LayoutEvent,
    PreemptionEvent,
    RunEvent,
    StartEvent,
    StepEvent,
)
from raytrain_hybrid.storage.nofollow import copy_new, create_new, open_below

# metrics.jsonl key -> TensorBoard tag
_SCALARS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "data_wait_s": "data/wait_s",
    "val_loss": "val/loss",
    "val_accuracy": "val/accuracy",
    "val_f1": "val/f1",
    "val_auc": "val/auc",
    "dropped_tokens": "moe/dropped_tokens",
    "router_aux_loss": "moe/router_aux_loss",
}
_MEMORY = ("param_bytes", "grad_bytes", "optimizer_bytes", "max_rss_bytes", "max_cuda_allocated_bytes")


@contextlib.contextmanager
def quiet_driver(log_path: Path, *, quiet: bool = True, keep=lambda: True):
    """Send what Ray prints on the driver to ``log_path`` and keep the terminal for the run.

    Ray writes start-up notices and Ray Data progress through loggers bound to stderr,
    raylet warnings ("N PYTHON worker processes have been started...") to ``sys.stdout``
    and its C++ core to file descriptor 2. Inside: fd 2 and ``sys.stdout`` go to a log;
    yields (terminal_out, terminal_err, live_log): the terminal for the progress bar and our
    own messages, and the log file as it is written (None when not quiet), which the run copies
    into its files at every checkpoint (RunDir.sync). The log is written in the temp dir and
    moved to ``log_path`` at the end if its directory exists (a refused run creates nothing in
    run.output_dir), and only if ``keep()``: a run refused by its checks leaves the directory as
    it was, which may be another run's (one on the same run.output_dir).
    """
    if not quiet:
        yield sys.stdout, sys.stderr, None
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd, tmp = tempfile.mkstemp(prefix="raytrain-hybrid-driver-", suffix=".log")
    log = os.fdopen(fd, "a", buffering=1)
    terminal_out = sys.stdout
    saved_fd = os.dup(2)
    # A sys.stderr that is not file descriptor 2 (pytest's capture, a notebook's stream) is not
    # moved by the dup2 below: it stays the place for our messages.
    terminal_err = os.fdopen(os.dup(2), "w", buffering=1) if _is_fd2(sys.stderr) else None
    os.dup2(log.fileno(), 2)
    sys.stdout = log
    try:
        yield terminal_out, terminal_err or sys.stderr, Path(tmp)
    finally:
        sys.stdout = terminal_out
        sys.stderr.flush()
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        if terminal_err is not None:
            terminal_err.close()
        log.close()
        if log_path.parent.is_dir() and keep():
            copy_new(tmp, log_path)  # (not shutil.move: across file systems it writes through a link)
        os.unlink(tmp)


def _is_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        return False


def _status(m: dict) -> str:
    line = f"loss {m['loss']:.4f}  grad_norm {m['grad_norm']:.3f}  {m['tokens_per_s']:,.0f} tok/s"
    if "val_accuracy" in m:  # a classifier's evaluation step
        auc = f"{m['val_auc']:.3f}" if m.get("val_auc") is not None else "n/a"
        line += f"  val acc {m['val_accuracy']:.3f} f1 {m['val_f1']:.3f} auc {auc}"
    return line


class RunLog:
    """Consumes the events of one run (launch.records.events): its starts, layouts, steps, checkpoints,
    preemption notices and end."""

    def __init__(
        self,
        out_dir: Path,
        *,
        steps: int,
        progress: bool,
        tensorboard: bool = True,
        history: list[dict] | None = None,
        stream=None,
        on_checkpoint=None,
        said: list[str] | None = None,
    ) -> None:
        stream = stream or sys.stdout  # the terminal, also when quiet_driver diverts sys.stdout
        self.steps = steps
        self.path = out_dir / "metrics.jsonl"
        self.history: list[dict] = []
        self.memory: list[dict] = []
        self.restarts = 0
        self.restarted_from: list[int] = []  # the step each restart continued from
        self.starts = 0  # worker groups started (the first, then one per restart)
        self.said = said or []  # what the driver printed before the run (layout=auto's foreseen pick)
        self.dp_starts: list[dict] = []  # per start: its step and layout (an elastic run's resizes)
        self.live_steps = 0  # steps reported by this launch's workers
        self.checkpoints: list[dict] = []  # step, path, write_s, save_s, blocked_s
        self.preemptions: list[dict] = []  # per notice: step saved, nodes, ranks, deadline; restarted_from
        self.marks: dict = {}  # rank 0's start-up phases (wall clock)
        self.on_checkpoint = on_checkpoint  # e.g. copy the run's files to its URI
        self.file = create_new(self.path)  # a link planted there is replaced, not followed
        for m in history or ():  # the steps a resumed run did before its checkpoint
            self._record(m)
        self.bar = self.lines = None
        if progress and stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=Console(file=stream),
            )
            self.task = self.bar.add_task("train", total=steps, status="starting workers")
            self.bar.start()
        elif progress:  # no terminal (a job's log, a pipe): plain lines a log keeps
            self.lines = stream
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # Its event files go into the run, not a link's target: one planted there is refused.
            os.close(open_below(str(out_dir), str(out_dir / "tensorboard"), create=True))
            self.tb = SummaryWriter(str(out_dir / "tensorboard"), flush_secs=10)

    def _say(self, text: str) -> None:
        text = redact(text)  # (a worker's error or a path may quote a URI)
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.lines is not None:
            print(text, file=self.lines, flush=True)

    def handle(self, event: RunEvent) -> None:
        if isinstance(event, StartEvent):
            # Rank 0 of every worker group says where it starts; every start after the first is
            # a restart (Ray Train's run.max_failures), also one that resumes past the last step
            # seen (a node lost after a checkpoint, before the next step was heard of).
            self.starts += 1
            if self.starts > 1:
                self._restarted(event.step)
            start = event.record()
            before = self.dp_starts[-1] if self.dp_starts else None
            if before is not None and any(before.get(k) != start.get(k) for k in _SHAPE):  # an elastic run resized
                self._say(f"resize: {_shape(before, start)}, continuing from step {event.step}")
            self.dp_starts.append(start)
        elif isinstance(event, LayoutEvent):  # an elastic run with layout=auto: the pick of this start
            for line in event.lines:
                if not (self.starts == 0 and line in self.said):  # the first start as the driver foresaw it
                    self._say(line)
        elif isinstance(event, StepEvent):
            self.live_steps += 1
            self._step(event.metrics)
        elif isinstance(event, CheckpointEvent):
            self.checkpoints.append(event.record())
            self._say(
                f"checkpoint: {event.step} steps -> {event.path} "
                f"({event.save_s:.2f} s, the steps held {event.blocked_s:.2f} s)"
            )
            if self.on_checkpoint is not None:
                if self.tb is not None:
                    _flush_tensorboard(self.tb)
                self.on_checkpoint()
        elif isinstance(event, PreemptionEvent):
            self._preempted(event.record())
        elif isinstance(event, DoneEvent):
            self.memory = event.memory
            self.marks = event.marks
            if self.tb is not None:
                for r in self.memory:  # one chart per quantity, one line per rank
                    for key in _MEMORY:
                        if r.get(key) is not None:
                            self.tb.add_scalar(f"memory/{key}/rank{r['rank']}", r[key], len(self.history))
        else:
            raise TypeError(f"not an event of a run: {event!r}")

    def _preempted(self, notice: dict) -> None:
        """Rank 0 says the ranks agreed on a preemption notice at step N (``saved`` None), then
        that they saved (and waited for) step N's checkpoint: told apart, so that a save the
        node's deadline cuts short still leaves the notice in the log and the summary."""
        if notice["saved"] is not None and self.preemptions and self.preemptions[-1]["step"] == notice["step"]:
            heard = self.preemptions[-1]
            heard.update(notice)
            if not notice["saved"]:
                self._say("  no checkpoint saved for it (checkpoint.interval=0)")
                return
            for c in self.checkpoints:
                if c["step"] == notice["step"]:
                    c["reason"] = "preemption"
            took = notice["saved_at"] - heard["noticed_at"]
            self._say(f"  saved step {notice['step']} ({took:.1f} s after the notice)")
            return
        self.preemptions.append(notice)
        deadline = notice.get("deadline_ms")
        when = f" in {deadline / 1000 - notice['noticed_at']:.0f} s" if deadline else ""
        nodes = ", ".join(n[:8] for n in notice.get("nodes", [])) or "?"
        self._say(
            f"preemption notice: node(s) {nodes} (ranks {notice.get('ranks', '?')}) go{when}; saving step "
            f"{notice['step']}; Ray Train restarts the group then, from the newest checkpoint"
        )

    def _restarted(self, step: int) -> None:
        """The worker group restarted from a checkpoint: the steps it redoes are dropped when
        their first comes (_step), not here: a fault-tolerant group restarted from step 0 may
        receive a live group's state at step 2 and redo nothing."""
        after = self.preemptions[-1] if self.preemptions and "restarted_from" not in self.preemptions[-1] else None
        if after is not None:  # the first start after a notice (Ray Train counts it apart from failures)
            after["restarted_from"] = step
        self.restarts += 1
        self.restarted_from.append(step)
        self.checkpoints = [c for c in self.checkpoints if c["step"] <= step]  # later ones are redone
        why = " after the preemption" if after is not None else ""
        self._say(f"restart {self.restarts}{why}: the worker group continues from step {step}")

    def _record(self, m: dict) -> None:
        self.history.append(m)
        self.file.write(json.dumps(m) + "\n")
        self.file.flush()

    def _step(self, m: dict) -> None:
        if self.history and self.history[-1]["step"] >= m["step"]:  # a restarted group redoes these
            kept = [h for h in self.history if h["step"] < m["step"]]
            self.file.close()
            self.file = create_new(self.path)
            self.history = []
            for h in kept:
                self._record(h)
        self._record(m)
        step = m["step"]
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, status=_status(m))
        if self.lines is not None:
            print(f"step {step + 1}/{self.steps}  {_status(m)}", file=self.lines, flush=True)
        if self.tb is not None:
            for key, tag in _SCALARS.items():
                if m.get(key) is not None:
                    self.tb.add_scalar(tag, m[key], step)
            for expert, tokens in enumerate(m.get("expert_load") or ()):  # mixtures of experts
                self.tb.add_scalar(f"moe/expert_load/{expert}", tokens, step)

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.stop()
        if self.tb is not None:
            self.tb.close()


def _flush_tensorboard(tb) -> None:
    """Every event added so far written to the file, before the file is copied to the output URI.

    tensorboardX writes events from a thread fed by a queue, and its ``flush()`` flushes the file
    without waiting for that queue. Stopping the thread (it drains the queue up to the stop
    signal), flushing, and starting a new one on the same file and queue makes it deterministic
    (what ``close()`` + ``reopen()`` do, without closing the file)."""
    from tensorboardX.event_file_writer import _EventLoggerThread

    writer = tb._get_file_writer().event_writer
    if writer._closed:
        return
    writer._worker.stop()
    writer._ev_writer.flush()
    writer._worker = _EventLoggerThread(writer._event_queue, writer._ev_writer, writer._flush_secs)
    writer._worker.start()


_SHAPE = ("dp", "tp", "pp")  # a start's layout, as a resize line names it


def _shape(before: dict, after: dict) -> str:
    """``dp 3 -> 2``, or with layout=auto's tp and pp when they changed too."""
    if all(before.get(k) == after.get(k) for k in _SHAPE[1:]):
        return f"dp {before['dp']} -> {after['dp']}"
    a, b = (" ".join(f"{k}={d[k]}" for k in _SHAPE) for d in (before, after))
    return f"{a} -> {b}"
