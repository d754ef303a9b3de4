"""Input for one data-parallel replica: its leader reads, the others receive by broadcast."""

from __future__ import annotations

import dataclasses
import queue
import threading

import torch
import torch.distributed as dist

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.corpus import Batch
from raytrain_hybrid.data.rows import feed_schema, schema_buffers, to_batch
from raytrain_hybrid.data.stream import StreamPosition, replica_stream
from raytrain_hybrid.distributed.parallel_dims import ParallelDims
from raytrain_hybrid.distributed.utils import mesh_device


class ReplicaFeed:
    """The step's rows for this replica: its leader reads the Ray Data stream, the other
    tp*pp ranks of the replica receive them by broadcast. A status goes first, so that the
    end of the data or a reading error stops every rank of the replica together.

    The broadcast of step k+1 is posted as soon as step k's rows arrive, so it travels while
    step k computes and the ranks behind the leader in the pipeline do not wait for it.
    """

    OK, END, ERROR = 1, 0, 2

    def __init__(
        self,
        cfg: Config,
        meshes,
        dims: ParallelDims,
        dp_rank: int,
        dataset_fn,
        skip_steps: int = 0,
        expect: dict | None = None,
    ) -> None:
        """``expect``: where the stream must stand after skipping ``skip_steps`` (the resumed
        checkpoint's data_position, which replica 0's leader recorded; checked there)."""
        self.group = meshes.replica.get_group()
        self.leader = meshes.replica.get_local_rank() == 0
        self.schema = feed_schema(cfg, cfg.train.global_batch_size // dims.dp)
        self.device = mesh_device(meshes.world)
        self.stream = None
        # Where the stream stands after the rows of the step last handed out (replica leaders):
        # the stream itself is read ahead by the reader thread, up to three steps.
        self.position: StreamPosition | None = None
        if self.leader:
            self.stream = replica_stream(cfg, dataset_fn(), dp=dims.dp, dp_rank=dp_rank, skip_steps=skip_steps)
        self.expect = expect if (skip_steps and dp_rank == 0 and expect) else None
        self._pending = None
        if self.leader:
            # Read in a thread from the start: Ray Data's executor spins up while the model builds.
            self._queue: queue.Queue = queue.Queue(maxsize=2)
            threading.Thread(target=self._read, daemon=True, name="replica-reader").start()

    def _read(self) -> None:
        try:
            for rows in self.stream:
                if self.expect is not None:
                    self._check_skip()
                self._queue.put((rows, dataclasses.replace(self.stream.position)))
            self._queue.put(StopIteration())
        except Exception as exc:  # handed to the training thread, which broadcasts it
            self._queue.put(exc)

    def _check_skip(self) -> None:
        got, self.expect, want = self.stream.position.skipped_to, None, self.expect
        if got != want:
            raise ValueError(
                f"after skipping the steps the checkpoint has done, the data stands at {got}, but the checkpoint "
                f"recorded {want}: the data under data.path is not what it was trained on (or is read in another "
                "order); resume with the same data, or start it from its beginning with --allow-change data.path"
            )

    def _post(self):
        status = torch.zeros(1, dtype=torch.int64, device=self.device)
        arrays = error = position = None
        if self.leader:
            item = self._queue.get()
            if isinstance(item, StopIteration):
                status.fill_(self.END)
            elif isinstance(item, Exception):  # still broadcast, so the replica does not hang
                status.fill_(self.ERROR)
                error = item
            else:
                rows, position = item
                arrays = rows if isinstance(rows, dict) else {"tokens": rows}
                status.fill_(self.OK)
        bufs = schema_buffers(self.schema, self.device, arrays)
        works = [dist.broadcast(t, group=self.group, group_src=0, async_op=True) for t in (status, *bufs.values())]
        return status, bufs, works, error, position

    def next(self) -> Batch | None:
        status, bufs, works, error, position = self._pending or self._post()
        self._pending = None
        if position is not None:
            self.position = position
        for work in works:
            work.wait()
        code = int(status.item())
        if code == self.ERROR:
            raise error if error is not None else RuntimeError("this replica's data leader failed reading")
        if code == self.END:
            return None
        self._pending = self._post()  # prefetch the next step's rows
        return to_batch({k: v.cpu() for k, v in bufs.items()})

    def close(self) -> None:
        """Complete the prefetch in flight (every rank of the replica posted it)."""
        if self._pending is not None:
            for work in self._pending[2]:
                work.wait()
            self._pending = None
