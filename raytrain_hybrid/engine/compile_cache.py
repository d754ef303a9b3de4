"""Compile warm starts (parallelism.compile_cache): a compiled run keeps torch.compile's caches
in its run directory, through the storage layer, so that a restart, an elastic resize with the
same shapes or a resume into that directory skips inductor's code generation and compilation.

Each rank compiles into an inductor cache directory of its own (TORCHINDUCTOR_CACHE_DIR, set here
before anything compiles): FX graphs, AOTAutograd's graphs, the generated C++ or Triton code and
the compiled kernels. After the first step that compiled, the rank archives that directory to
``compile_cache/rank<R>.tar`` in the run directory; a later start extracts its own archive (or
rank 0's, when there are more ranks than before: every rank compiles the same block code) before
its first step, on whichever node it lands. Dynamo still traces each block (about a second);
entries compiled for other shapes, another torch or another GPU are simply not hit.
``torch.compiler.save_cache_artifacts`` was measured too: it skips code generation but not the
C++ compilation of CPU kernels."""

from __future__ import annotations

import io
import logging
import os
import tarfile
import tempfile

import torch.distributed as dist

from raytrain_hybrid.storage import Store, open_store, private_dir

CACHE_DIR = "compile_cache"
log = logging.getLogger(__name__)


class CompileCache:
    def __init__(self, store: Store, rank: int, local: str) -> None:
        self.store, self.rank, self.local = store, rank, local
        self.saved = False

    @classmethod
    def open(cls, cfg, trainer) -> CompileCache | None:
        """The run's cache for a compiled run with parallelism.compile_cache, else None."""
        if not (trainer.compiled and cfg.parallelism.compile_cache):
            return None
        from torch._inductor.utils import clear_caches

        local = tempfile.mkdtemp(prefix="inductor_", dir=private_dir())  # this process's own
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = local
        clear_caches()  # paths inductor derived from an earlier directory
        return cls(open_store(cfg.run.output_dir).child(CACHE_DIR), dist.get_rank(), local)

    def _archive(self, rank: int) -> Store:
        return self.store.child(f"rank{rank}.tar")

    def load(self) -> int:
        """Extract this rank's archive (or rank 0's) before the first compile; files extracted."""
        for rank in dict.fromkeys((self.rank, 0)):
            archive = self._archive(rank)
            if not archive.exists():
                continue
            try:
                with tarfile.open(fileobj=io.BytesIO(archive.read_bytes())) as tar:
                    members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
                    tar.extractall(self.local, members=members, filter="data")  # no links, nothing outside
            except (tarfile.TarError, OSError) as exc:  # compiled cold instead
                log.warning("compile cache %s not used: %s", archive, exc)
                return 0
            return sum(m.isfile() for m in members)
        return 0

    def after_step(self, metrics: dict) -> None:
        """Archive the cache once, after the first step that compiled."""
        if self.saved or not metrics.get("compiles"):
            return
        self.saved = True
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.add(self.local, arcname=".")
        try:
            self._archive(self.rank).write_bytes(buffer.getvalue())
        except OSError as exc:  # a warm start is an optimisation: the run goes on without it
            log.warning("compile cache not written to %s: %s", self.store, exc)
