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

    .venv/bin/python benchmarks/bench_entry_check.py --s3

The same checks of a checkpoint on S3 (the tests' local moto server, tests/s3_server.py), through
a proxy that counts the requests and the bytes each way; recorded under ``"s3"`` in the same
JSON. moto reads a whole object for every ranged GET, so this checkpoint keeps the entries (24
layers: 1,535) with small tensors (hidden 64, vocabulary 4,096): the requests and bytes an entry
costs are the check's, which do not depend on the tensors' sizes; the wall time is moto's on
loopback, not a real bucket's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import re
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


def measured(fn, repeats: int = 3, proxy=None) -> dict:
    """``fn`` run ``repeats`` times: each run's wall and CPU seconds (the machine is shared: the
    wall clock moves with its load), and the bytes the last run read; with ``proxy`` (S3), the
    requests and bytes of the last run as they went through it."""
    walls, cpus = [], []
    for _ in range(repeats):
        if proxy is not None:
            proxy.reset()
        rchar, cpu, wall = _rchar(), time.process_time(), time.perf_counter()
        fn()
        walls.append(round(time.perf_counter() - wall, 3))
        cpus.append(round(time.process_time() - cpu, 3))
    return {"wall_s": walls, "cpu_s": cpus, "bytes_read": _rchar() - rchar} | (proxy.counts() if proxy else {})


_REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) \S+ HTTP/1\.1\r\n")


class Proxy:
    """A TCP proxy in front of the S3 server, in a process of its own (its CPU is not the
    check's), counting the requests by method and the bytes each way; ``reset`` and ``counts``
    ask it over a pipe."""

    def __init__(self, target: str) -> None:
        port = target.rsplit(":", 1)[1]
        self.proc = subprocess.Popen([sys.executable, __file__, "proxy", port], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.proc.stdout.readline().strip()}"

    def _ask(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def reset(self) -> None:
        self._ask("reset")

    def counts(self) -> dict:
        return self._ask("counts")

    def stop(self) -> None:
        self.proc.kill()


def _serve_proxy(target: int) -> None:
    import collections
    import threading

    lock, state = threading.Lock(), {}

    def reset() -> None:
        state.update(requests=collections.Counter(), bytes_sent=0, bytes_received=0)

    def pump(src: socket.socket, dst: socket.socket, asking: bool) -> None:
        tail = b""
        try:
            while data := src.recv(1 << 16):
                with lock:
                    if asking:  # a request line may be cut between two reads: the unmatched tail is kept
                        state["bytes_sent"] += len(data)
                        seen, done = tail + data, 0
                        for m in _REQUEST.finditer(seen):
                            state["requests"][m.group(1).decode()] += 1
                            done = m.end()
                        tail = seen[max(done, len(seen) - 512) :]
                    else:
                        state["bytes_received"] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def accept(server: socket.socket) -> None:
        while True:
            client, _ = server.accept()
            upstream = socket.create_connection(("127.0.0.1", target))
            for a, b, asking in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=pump, args=(a, b, asking), daemon=True).start()

    reset()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    threading.Thread(target=accept, args=(server,), daemon=True).start()
    print(server.getsockname()[1], flush=True)
    for line in sys.stdin:
        with lock:
            if line.strip() == "reset":
                reset()
            requests = dict(state["requests"])
            said = {"requests": sum(requests.values()), "requests_by_method": requests}
            said |= {k: state[k] for k in ("bytes_sent", "bytes_received")}
        print(json.dumps(said), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=None, help="default 1024 (--s3: 64)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=None, help="default 16 (--s3: 4)")
    ap.add_argument("--vocab", type=int, default=None, help="default 32000 (--s3: 4096)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--s3", action="store_true", help="check it on the local S3 server; recorded under 's3'")
    args = ap.parse_args()
    small = dict(hidden=64, heads=4, vocab=4096) if args.s3 else dict(hidden=1024, heads=16, vocab=32000)
    for key, value in small.items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    proxy = None
    if args.s3:  # the endpoint, through the counting proxy, before pyarrow's S3 is set up
        sys.path.insert(0, str(ROOT / "tests"))
        import s3_server

        env = s3_server.fresh_buckets("bench")
        proxy = Proxy(env["AWS_ENDPOINT_URL"])
        os.environ.update(env | {"AWS_ENDPOINT_URL": proxy.url})

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
        where = str(run_dir)
        if args.s3:  # the checkpoint as a run on S3 leaves it
            where = "s3://bench/run"
            open_store(where).upload(str(run_dir))
            overrides = [o for o in overrides if not o.startswith("run.output_dir=")] + [f"run.output_dir={where}"]
        step = open_store(f"{where}/checkpoints/step_1")
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
        unblocked = measured(lambda: mf._check_entries(step, md, "--resume"), repeats=1, proxy=proxy)
        unblocked["reads_per_entry"] = round((reads[0] - entry_reads) / entries, 2)
        entry_ranges.BLOCK = block
        checks = {
            # sizes, manifest and .metadata against them: what a resume asks of a later checkpoint
            "sizes_and_metadata": measured(lambda: mf.verify(step, digests=False), proxy=proxy),
            # every shard entry's archive directory and description, no tensor bytes
            "entries": measured(lambda: mf._check_entries(step, md, "--resume"), proxy=proxy),
            # all of the driver's check of a checkpoint under 64 GiB: every file's SHA-256 too
            "whole_verify_with_digests": measured(lambda: mf.verify(step, digests=True), proxy=proxy),
            # the entry check without read blocks (checkpoint.entry_ranges.BLOCK = 0), once
            "entries_without_blocks": unblocked,
        }
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proxy is not None:
            proxy.reset()
        wall = time.perf_counter()
        cli = [str(ROOT / ".venv" / "bin" / "raytrain-hybrid"), "check", "--resume", where,
               *[a for o in overrides if o != "train.steps=1" for a in ("--set", o)],
               "--set", "train.steps=2", "--allow-change", "train.steps"]  # fmt: skip
        done = subprocess.run(cli, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"check --resume failed ({done.returncode}): {done.stderr[-2000:]}")
        checks["cli_check_resume"] = {
            "wall_s": round(time.perf_counter() - wall, 3),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 3),
        } | (proxy.counts() if proxy else {})
    if proxy is not None:
        proxy.stop()
    total = sum(sizes.values())
    fetched = "bytes_received" if args.s3 else "bytes_read"  # (rchar counts no socket's bytes)
    result = {
        "command": ("cd <repo> && .venv/bin/python benchmarks/bench_entry_check.py " + " ".join(sys.argv[1:])).strip(),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, {'S3 (moto on loopback)' if args.s3 else 'local disk'}; shared with "
        f"other jobs (load {os.getloadavg()[0]:.1f})",
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
        "entries_bytes_read_over_checkpoint": round(checks["entries"][fetched] / total, 6),
        "entries_bytes_read_per_entry": round(checks["entries"][fetched] / entries),
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
    if args.s3:
        result["note"] += S3_NOTE
        result = json.loads(Path(args.out).read_text()) | {"s3": result}  # beside the local disk's figures
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


S3_NOTE = (
    " On S3: bytes_received, bytes_sent and requests are what went through a proxy in front of the "
    "server (responses' headers included; the last run's); bytes_read (rchar) does not see sockets. "
    "moto reads a whole object for every ranged GET: the checkpoint has the entries of the local one "
    "(24 layers) and small tensors, and wall_s is moto's on loopback, not a real bucket's."
)


if __name__ == "__main__" and sys.argv[1:2] == ["proxy"]:
    _serve_proxy(int(sys.argv[2]))
elif __name__ == "__main__":
    main()
