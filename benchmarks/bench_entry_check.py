"""What the driver's checkpoint checks cost on a checkpoint of realistic size.

    .venv/bin/python benchmarks/bench_entry_check.py [--hidden 1024 --layers 24 --vocab 32000]

Before any worker starts, the driver checks the checkpoint a run resumes from (or ``export``
reads): the manifest, the files' sizes, DCP's ``.metadata`` against them, every shard entry's
``torch.save`` archive read as data (its directory and description: ``checkpoint.entry_ranges``,
never its tensor bytes), and, for a checkpoint of up to 64 GiB, every file's SHA-256. This
writes one such checkpoint as a run does (two gloo ranks run the engine's worker loop one step,
FSDP's ZeRO-3 at dp=2, so every tensor is two chunks; fp32 Llama with AdamW), then measures each
check alone, in this process: wall and CPU seconds and the bytes read (``rchar`` of
/proc/self/io: every byte read through a system call, from the page cache or the disk), and
``check --resume <run dir>`` as a user runs it (wall, and the CPU of the process). The checkpoint
was written just before, so its files are likely in the page cache: the digest's wall time is
the cached one; its bytes are what a cold read fetches.

Writes benchmarks/results/entry_check.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "entry_check.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.plan import WorkerPlan
    from raytrain_hybrid.engine.worker import run_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, overrides)
    run_worker(WorkerPlan(cfg, launch_id="bench"), "node0")
    dist.barrier()
    os._exit(0)


def write_checkpoint(overrides: list[str]) -> float:
    """Two ranks train one step and save it; the seconds it took."""
    ctx = mp.get_context("spawn")
    port, t0 = _port(), time.perf_counter()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, overrides)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: {[p.exitcode for p in procs]}")
    return time.perf_counter() - t0


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def measured(fn, repeats: int = 3) -> dict:
    """``fn`` run ``repeats`` times: each run's wall and CPU seconds (the machine is shared: the
    wall clock moves with its load), and the bytes the last run read."""
    walls, cpus = [], []
    for _ in range(repeats):
        rchar, cpu, wall = _rchar(), time.process_time(), time.perf_counter()
        fn()
        walls.append(round(time.perf_counter() - wall, 3))
        cpus.append(round(time.process_time() - cpu, 3))
    return {"wall_s": walls, "cpu_s": cpus, "bytes_read": _rchar() - rchar}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    args = ap.parse_args()

    from raytrain_hybrid.checkpoint import manifest as mf
    from raytrain_hybrid.storage import open_store

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run_dir = Path(tmp) / "run"
        model = [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                 f"model.num_heads={args.heads}", f"model.vocab_size={args.vocab}", "model.seq_len=32"]  # fmt: skip
        overrides = [*model, "data.path=memory", "parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1",
                     "parallelism.zero=3", "parallelism.microbatches=1", "train.global_batch_size=2",
                     "train.steps=1", "checkpoint.interval=1", f"run.output_dir={run_dir}"]  # fmt: skip
        write_s = write_checkpoint(overrides)
        step = open_store(str(run_dir / "checkpoints" / "step_1"))
        manifest = json.loads(step.child(mf.MANIFEST).read_text())
        sizes = {name: f["size"] for name, f in manifest["files"].items()}
        md = mf._check_metadata(step, manifest["files"], "--resume")  # (its imports are not a check's)
        entries = len(md.storage_data)

        from raytrain_hybrid.checkpoint import entry_ranges

        reads = [0]  # the entry check's reads of a shard: each a request on object storage
        fetch = entry_ranges._Window._fetch

        def counted(window, start: int, end: int) -> bytes:
            reads[0] += 1
            return fetch(window, start, end)

        entry_ranges._Window._fetch = counted
        mf._check_entries(step, md, "--resume")
        entry_reads = reads[0]
        block, entry_ranges.BLOCK = entry_ranges.BLOCK, 0  # every read a request of its own, as before BLOCK
        unblocked = measured(lambda: mf._check_entries(step, md, "--resume"), repeats=1)
        unblocked["reads_per_entry"] = round((reads[0] - entry_reads) / entries, 2)
        entry_ranges.BLOCK = block
        checks = {
            # sizes, manifest and .metadata against them: what a resume asks of a later checkpoint
            "sizes_and_metadata": measured(lambda: mf.verify(step, digests=False)),
            # every shard entry's archive directory and description, no tensor bytes
            "entries": measured(lambda: mf._check_entries(step, md, "--resume")),
            # all of the driver's check of a checkpoint under 64 GiB: every file's SHA-256 too
            "whole_verify_with_digests": measured(lambda: mf.verify(step, digests=True)),
            # the entry check without read blocks (checkpoint.entry_ranges.BLOCK = 0), once
            "entries_without_blocks": unblocked,
        }
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        cli = [str(ROOT / ".venv" / "bin" / "raytrain-hybrid"), "check", "--resume", str(run_dir),
               *[a for o in overrides if o != "train.steps=1" for a in ("--set", o)],
               "--set", "train.steps=2", "--allow-change", "train.steps"]  # fmt: skip
        done = subprocess.run(cli, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"check --resume failed ({done.returncode}): {done.stderr[-2000:]}")
        checks["cli_check_resume"] = {
            "wall_s": round(time.perf_counter() - wall, 3),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 3),
        }
    total = sum(sizes.values())
    result = {
        "command": ("cd <repo> && .venv/bin/python benchmarks/bench_entry_check.py " + " ".join(sys.argv[1:])).strip(),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, local disk; shared with other jobs (load {os.getloadavg()[0]:.1f})",
        "checkpoint": {
            "made_by": "two gloo ranks, one step of the engine's worker loop, dp=2 zero=3 (FSDP), fp32 "
            "Llama with AdamW, checkpoint.interval=1",
            "model": dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, vocab_size=args.vocab),
            "bytes": total,
            "files": len(sizes),
            "largest_file_bytes": max(sizes.values()),
            "entries": entries,
            "write_s": round(write_s, 1),
        },
        "checks": checks,
        "entries_bytes_read_over_checkpoint": round(checks["entries"]["bytes_read"] / total, 6),
        "entries_bytes_read_per_entry": round(checks["entries"]["bytes_read"] / entries),
        # the entry check's reads of a shard (each a request on object storage), per entry
        "entries_reads_per_entry": round(entry_reads / entries, 2),
        "block_bytes": block,
        "note": "each check run 3 times in a row (wall_s, cpu_s: each run's); bytes_read: rchar of "
        "/proc/self/io around the last run (page cache or disk alike). The entry "
        "check reads each entry's archive directory, data.pkl and one local header; the digests read every "
        "byte (up to checkpoint.manifest.DIGEST_LIMIT_BYTES, 64 GiB; a larger checkpoint is checked by "
        "sizes, metadata and entries). cli_check_resume: the whole command, its start and imports "
        "included, digests too.",
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
