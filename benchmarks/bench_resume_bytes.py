"""Bytes fetched from object storage per node, against the bytes its ranks hold: a resume and a
pretrained load, read by range straight from the bucket.

    .venv/bin/python benchmarks/bench_resume_bytes.py [--layers 8 --hidden 256 --vocab 4096]

A two-node cluster simulated on this machine: 8 gloo ranks (tests/gloo_harness.py's forked
processes), ranks 0-3 on node A and 4-7 on node B, as Ray places 8 workers on two 4-GPU nodes
(ranks handed out node by node). Each node reaches the S3 server (moto's, on loopback) through
a counting HTTP proxy of its own, so a node's "fetched" bytes are every response body its
ranks received from storage (object ranges, listings); no node-level cache exists, so this is
the sum over its ranks. Each rank also reports its readers' own count (``bytes_read``) and the
bytes it holds:

- a resume (``engine.worker.run_worker(resume=<s3 checkpoint>)``, the worker code Ray Train
  runs): the nbytes of the local shards of the model and AdamW state the rank loads (the
  ``state`` handed to ``checkpoint.reader.safe_load``); checkpoints saved at (2,2,2) ZeRO-3
  and at (4,1,2) ZeRO-1, each resumed at both layouts;
- a pretrained load (``engine.trainer.Trainer`` from ``model.pretrained=s3://...``, a Llama
  written by transformers' ``save_pretrained`` in fp32, the engine's dtype, so that bytes
  compare like with like): the nbytes of the rank's parameter shards.

ratio = node's fetched bytes / bytes its ranks hold (goal <= 1.1). The disk high-water mark:
every rank samples (every 10 ms) the bytes of the files under its node's temp, cache and
Hugging Face directories (TMPDIR, RAYTRAIN_HYBRID_CACHE, HF_HOME point there) while it loads;
a node's mark is the largest rise over its ranks. Result: benchmarks/results/resume_bytes.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "resume_bytes.json"
sys.path.insert(0, str(ROOT / "tests"))  # gloo_harness: the engine's worker code in forked gloo ranks

RANKS_PER_NODE = 4
NODES = ("A", "B")
LAYOUTS = {  # name -> overrides; the ZeRO stages tests/test_pretrained.py runs them with
    "2x2x2-zero3": ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.zero=3"],
    "4x1x2-zero1": ["parallelism.dp=4", "parallelism.tp=1", "parallelism.pp=2", "parallelism.zero=1"],
}


# ------------------------------------------------------------------ the S3 server and the nodes' links


# Objects the links fetched whole from moto, to serve ranges of (path -> (headers, bytes)): moto
# copies the whole object for every ranged GET, so a load of thousands of row ranges would take
# hours there (S3 itself serves a range at the cost of the range). Cleared before each case.
_OBJECTS: dict[str, tuple[list, bytes]] = {}
_OBJECTS_LOCK = threading.Lock()


class _Counting(BaseHTTPRequestHandler):
    """Forwards each request to the S3 server (a ranged GET: served from the object, fetched
    whole once), counting the response bytes sent to the node, per kind of request."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _upstream(self, method: str, headers: dict, body=None):
        if not hasattr(self, "upstream"):
            self.upstream = http.client.HTTPConnection(*self.server.target, timeout=120)
        self.upstream.request(method, self.path, body=body, headers=headers)
        resp = self.upstream.getresponse()
        return resp.status, resp.reason, resp.getheaders(), resp.read()

    def _ranged(self, headers: dict):
        """(status, reason, headers, body) of a single-range GET of an object, from its copy."""
        unit, _, spec = self.headers["Range"].partition("=")
        first, _, last = spec.partition("-")
        if unit != "bytes" or "," in spec or not first.isdigit() or not last.isdigit():
            return None
        with _OBJECTS_LOCK:
            if self.path not in _OBJECTS:
                status, _, got, data = self._upstream("GET", {k: v for k, v in headers.items() if k.lower() != "range"})
                if status != 200:
                    return None
                _OBJECTS[self.path] = ([(k, v) for k, v in got if not k.lower().startswith("x-amz-checksum")], data)
            got, data = _OBJECTS[self.path]
        first, last = int(first), min(int(last), len(data) - 1)
        return (
            206,
            "Partial Content",
            [*got, ("Content-Range", f"bytes {first}-{last}/{len(data)}")],
            data[first : last + 1],
        )

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
        query = urlsplit(self.path).query
        listing = "list-type" in query or query.startswith("location")
        answer = None
        if self.command == "GET" and "Range" in self.headers and not listing:
            answer = self._ranged(headers)
        status, reason, got, data = answer or self._upstream(self.command, headers, body)
        self.send_response_only(status, reason)
        for k, v in got:
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "content-range") or (
                answer and k == "Content-Range"
            ):
                self.send_header(k, v)
        size = dict((k.lower(), v) for k, v in got).get("content-length") if self.command == "HEAD" else str(len(data))
        self.send_header("Content-Length", size or "0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        kind = self.command
        if self.command == "GET":
            kind = "GET listing" if listing else "GET object"
        with self.server.lock:
            row = self.server.counts.setdefault(kind, {"requests": 0, "bytes": 0})
            row["requests"] += 1
            row["bytes"] += len(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class Link(ThreadingHTTPServer):
    """One node's way to the S3 server: a proxy that counts what comes back."""

    daemon_threads = True

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(("127.0.0.1", 0), _Counting)
        self.target, self.lock, self.counts = target, threading.Lock(), {}
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def take(self) -> dict:
        with self.lock:
            counts, self.counts = self.counts, {}
        return counts


def start_s3() -> dict:
    """tests/s3_server.py's moto server (stopped at exit) with an empty bucket, exported here."""
    from s3_server import fresh_buckets

    env = fresh_buckets("bucket")
    os.environ.update(env)
    return env


# ------------------------------------------------------------------ in each rank


def _files_bytes(root: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


class DiskWatch(threading.Thread):
    """The largest rise of the bytes under ``root`` while it runs (sampled every 10 ms)."""

    def __init__(self, root: str) -> None:
        super().__init__(daemon=True)
        self.root, self.base = root, _files_bytes(root)
        self.peak, self.done = self.base, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, _files_bytes(self.root))
            time.sleep(0.01)

    def stop(self) -> int:
        self.done.set()
        self.join()
        self.peak = max(self.peak, _files_bytes(self.root))
        return self.peak - self.base


def _as_node(rank: int, links: list[str], node_dirs: list[str]) -> int:
    """This rank's node: its link to storage and its disk (before anything opens either)."""
    node = rank // RANKS_PER_NODE
    root = node_dirs[node]
    os.environ.update(
        AWS_ENDPOINT_URL=links[node],
        TMPDIR=f"{root}/tmp",
        RAYTRAIN_HYBRID_CACHE=f"{root}/cache",
        HF_HOME=f"{root}/hf",
    )
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return node


def _nbytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _gather(record: dict) -> dict:
    import torch.distributed as dist

    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(record, parts, dst=0)
    return {"ranks": parts}


def _resume_rank(rank: int, world: int, overrides: list[str], ckpt: str, links: list[str], node_dirs: list[str]):
    node = _as_node(rank, links, node_dirs)
    from raytrain_hybrid.checkpoint import state as state_mod
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine import worker

    record: dict = {"rank": rank, "node": NODES[node]}
    safe_load, load_checkpoint = state_mod.safe_load, worker.load_checkpoint

    def counted(state, path, **kwargs):
        reader = safe_load(state, path, **kwargs)
        record["reader_bytes"] = reader.bytes_read
        record["held_bytes"] = _nbytes(state["model"].values()) + _nbytes(state["optimizer"].values())
        return reader

    def watched(trainer, cfg, path):
        watch = DiskWatch(node_dirs[node])
        t = time.perf_counter()
        out = load_checkpoint(trainer, cfg, path)
        record["load_s"] = round(time.perf_counter() - t, 3)
        record["disk_rise_bytes"] = watch.stop()
        return out

    state_mod.safe_load, worker.load_checkpoint = counted, watched  # this process only
    worker.run_worker(load_config(None, overrides), node_id=f"node{node}", resume=ckpt)
    return _gather(record)


def _pretrained_rank(rank: int, world: int, overrides: list[str], links: list[str], node_dirs: list[str]):
    node = _as_node(rank, links, node_dirs)
    import torch

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
    from raytrain_hybrid.engine import trainer as trainer_mod

    readers = []
    load = trainer_mod.load_hf_weights
    trainer_mod.load_hf_weights = lambda *a, **k: readers.append(load(*a, **k))  # this process only
    cfg = load_config(None, overrides)
    dims = ParallelDims.from_config(cfg.parallelism)
    nodes = [f"node{r // RANKS_PER_NODE}" for r in range(world)]
    watch = DiskWatch(node_dirs[node])
    t = time.perf_counter()
    trainer = trainer_mod.Trainer(cfg, dims, dims.build_mesh("cpu", arrange_ranks(dims, nodes)), torch.device("cpu"))
    record = {
        "rank": rank,
        "node": NODES[node],
        "build_s": round(time.perf_counter() - t, 3),
        "disk_rise_bytes": watch.stop(),
        "reader_bytes": sum(r.bytes_read for r in readers),
        "held_bytes": _nbytes(trainer.params),
    }
    return _gather(record)


# ------------------------------------------------------------------ the driver of the benchmark


def make_pretrained(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain_hybrid.models.llama import default_ffn

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=default_ffn(hidden),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    # 2 MB shards: moto copies a whole object for every ranged GET (a real S3 does not).
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="2MB")


def _node_rows(ranks: list[dict], counts: list[dict]) -> dict:
    out = {}
    for node, name in enumerate(NODES):
        mine = [r for r in ranks if r["node"] == name]
        held = sum(r["held_bytes"] for r in mine)
        objects = counts[node].get("GET object", {"bytes": 0, "requests": 0})
        fetched = sum(c["bytes"] for k, c in counts[node].items() if k.startswith("GET"))
        out[name] = {
            "ranks": [r["rank"] for r in mine],
            "held_bytes": held,
            "fetched_bytes": fetched,
            "fetched_object_bytes": objects["bytes"],
            "readers_bytes": sum(r["reader_bytes"] for r in mine),
            "ratio": round(fetched / held, 4),
            "requests": {k: c["requests"] for k, c in sorted(counts[node].items())},
            "disk_high_water_bytes": max(r["disk_rise_bytes"] for r in mine),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    from gloo_harness import launch_ranks

    from raytrain_hybrid.storage import open_store

    work = Path(tempfile.mkdtemp(prefix="bench-resume-bytes-"))
    env = start_s3()
    server = urlsplit(env["AWS_ENDPOINT_URL"])
    links = [Link((server.hostname, server.port)) for _ in NODES]
    node_dirs = [str(work / f"node{n}") for n in NODES]
    for d in node_dirs:
        for sub in ("tmp", "cache", "hf"):
            os.makedirs(f"{d}/{sub}")
    model = [
        "model.arch=llama",
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        f"model.num_heads={args.hidden // 64}",
        f"model.num_kv_heads={args.hidden // 64}",
        f"model.vocab_size={args.vocab}",
    ]
    common = ["model.seq_len=64", "train.global_batch_size=8", "parallelism.microbatches=2", "data.path=memory"]
    cases = []

    def measure(body, *job) -> dict:
        """One launch of 8 ranks, each through its node's link; the nodes' figures."""
        t = time.perf_counter()
        for link in links:
            link.take()
        _OBJECTS.clear()
        got = launch_ranks(body, 8, *job, [link.url for link in links], node_dirs, env=env)
        nodes = _node_rows(got["ranks"], [link.take() for link in links])
        return {"seconds": round(time.perf_counter() - t, 1), "nodes": nodes, "per_rank": got["ranks"]}

    # A checkpoint (after 2 steps) saved at each layout, written by the workers to the bucket.
    for name, layout in LAYOUTS.items():
        save = [
            *model,
            *common,
            *layout,
            "train.steps=2",
            "checkpoint.interval=2",
            f"run.output_dir=s3://bucket/{name}",
        ]
        launch_ranks(_resume_rank, 8, save, None, [env["AWS_ENDPOINT_URL"]] * 2, node_dirs, env=env)
    for saved in LAYOUTS:
        ckpt = open_store(f"s3://bucket/{saved}/checkpoints/step_2")
        files = {n: ckpt.child(n).size() for n in ckpt.listdir()}
        for name, layout in LAYOUTS.items():
            resume = [*model, *common, *layout, "train.steps=2", f"run.output_dir=s3://bucket/resumed-{saved}-{name}"]
            case = {"kind": "resume", "saved_at": saved, "loaded_at": name, "checkpoint_files": files}
            cases.append({**case, **measure(_resume_rank, resume, ckpt.uri)})
            print(f"resume {saved} -> {name}: {json.dumps({k: v['ratio'] for k, v in cases[-1]['nodes'].items()})}")
    src = work / "llama-pretrained"
    make_pretrained(src, args.hidden, args.layers, args.vocab)
    open_store("s3://bucket/pretrained/llama").upload(str(src))
    files = {f.name: f.stat().st_size for f in sorted(src.iterdir())}
    for name, layout in LAYOUTS.items():
        load = ["model.pretrained=s3://bucket/pretrained/llama", *common, *layout]
        cases.append({"kind": "pretrained", "loaded_at": name, "files": files, **measure(_pretrained_rank, load)})
        print(f"pretrained -> {name}: {json.dumps({k: v['ratio'] for k, v in cases[-1]['nodes'].items()})}")
    write(args, cases)


def write(args, cases: list[dict]) -> None:
    import moto
    import pyarrow
    import torch

    worst = max(n["ratio"] for c in cases for n in c["nodes"].values())
    result = {
        "command": "cd <repo> && .venv/bin/python " + " ".join(["benchmarks/bench_resume_bytes.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "time_utc": time.strftime("%H:%M", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pyarrow": pyarrow.__version__,
            "moto": moto.__version__,
            "load_average_1min_at_end": os.getloadavg()[0],
        },
        "cluster": "8 gloo ranks (forked processes, tests/gloo_harness.py) in two simulated nodes: ranks 0-3 node A, "
        "4-7 node B, as Ray places 8 workers on two 4-GPU nodes; each node reaches moto's S3 server through a "
        "counting proxy of its own; no node-level cache exists, so a node's fetched bytes are its ranks' sum",
        "model": {
            "arch": "llama",
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "dtype": "float32",
        },
        "definitions": {
            "fetched_bytes": "response bodies of every GET the node's ranks sent to storage (ranges, listings)",
            "held_bytes": "nbytes of the local shards of the state each rank loads, summed over the node's ranks "
            "(resume: model + AdamW state; pretrained: the parameters)",
            "ratio": "fetched_bytes / held_bytes",
            "disk_high_water_bytes": "largest rise of the bytes of the files under the node's TMPDIR, "
            "RAYTRAIN_HYBRID_CACHE and HF_HOME while a rank of it loaded (sampled every 10 ms)",
        },
        "goal": "ratio <= 1.1 for a resume and a pretrained load; disk high-water mark during a resume ~0",
        "notes": [
            "Each link serves a ranged GET from a copy of the object it fetched whole from moto once per case (moto "
            "copies the whole object for every ranged GET; S3 does not); the bytes counted are those sent to the node.",
            "Before checkpoint.entry_ranges, the resume saved at 4x1x2-zero1 and loaded at 2x2x2-zero3 fetched 4.04x "
            "per node: each rank read every whole-tensor entry whole to keep its TP/FSDP part (this benchmark, "
            "2026-11-25 21:40 UTC), and with the metadata fetched three times per rank the other resumes were 1.071 "
            "(2x2x2-zero3 -> 2x2x2-zero3), 1.026 and 1.012.",
            "What a node fetches beyond its share: .metadata twice per rank (the worker's size/metadata verify and "
            "the reader), each entry's torch.save archive structure (~1.5 KB; AdamW's 'step' scalars hold 4 bytes "
            "each), manifest reads and listings; for a pretrained load the safetensors headers, config.json, listings.",
            "Column blocks (TP's row-wise split: o_proj, down_proj) are read as one range per row: exact bytes, many "
            "small requests (the requests per node are in each case); on S3 with narrow rows this trades requests "
            "for bytes.",
        ],
        "worst_ratio": worst,
        "meets_goal": worst <= 1.1,
        "cases": cases,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"worst ratio {worst}; wrote {args.out}")


if __name__ == "__main__":
    main()
