"""Checkpoint benchmark.

    .venv/bin/python benchmarks/bench_checkpoint.py [--part overlap|save-load] [--hidden 256 --layers 8]

At (dp, tp, pp) = (2, 2, 2), fp32 Llama (8.5M parameters by default: 102 MB of weights and
AdamW moments), 1F1B, 4 micro-batches.

``--part overlap`` (default; writes benchmarks/results/checkpoint_async.json): what saving
costs the step loop. 8 gloo processes on the corpus in memory run the engine's worker loop
(engine.worker.run_worker, as a Ray Train worker does, without Ray) for ``--steps`` steps with
no checkpoints, with synchronous saves and with background saves (checkpoint.async_save) every
``--every`` steps, on local disk and on the local S3 server (moto on loopback, as
tests/s3_server.py starts it). Per run: the wall time per step from the end of the second step
(warm-up) to the end of the run, the final save's wait included; per save: ``blocked_s`` (the
step loop waited: copy, barrier, agreeing it is done, waiting for it), ``write_s`` (DCP's write
of the shards) and ``save_s`` (to the manifest or rename), and the blocked fraction of a step
(blocked_s over the step time without saves).

``--part save-load`` (writes benchmarks/results/checkpoint.json), on local Ray (8 gloo
workers) with synchronous saves: (1) save: seconds per checkpoint (DCP's write of the shards,
and all of it: hashing, manifest, rename, barriers) against the step time; (2) load: seconds
to load a checkpoint when a run resumes at (2, 2, 2) and when it reshards to (1, 1, 1); (3)
size: bytes on disk against the model's state (fp32 weights and the two AdamW moments, 12
bytes a parameter), and the largest per-rank file against an even 1/8 share.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

OUT = Path(__file__).resolve().parent / "results"
LAYOUT = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.microbatches=4"]


def param_count(cfg) -> int:
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.common import build_stage

    spec = get_arch(cfg.model.arch)
    meta = build_stage(spec, spec.hf_config(cfg), list(range(cfg.model.num_layers)), first=True, last=True)
    return sum(p.numel() for p in meta.parameters())


# ---------------------------------------------------------------- overlap: gloo processes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, overrides: list[str], env: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
    from raytrain_hybrid.engine.worker import run_worker

    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ends: list[float] = []  # rank 0: wall clock at the end of each step
    cfg = load_config(None, overrides)
    plan = WorkerPlan(cfg, launch_id=os.path.basename(cfg.run.output_dir))
    result = run_worker(plan, "node0", WorkerIO(on_step=lambda m: ends.append(time.perf_counter())))
    if rank == 0:
        queue.put({"history": result["history"], "ends": ends, "returned": time.perf_counter()})
    dist.barrier()
    os._exit(0)


def _run(overrides: list[str], env: dict) -> dict:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.tensor", "raytrain_hybrid.engine.worker"])
    queue, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_rank, args=(r, 8, port, overrides, env, queue)) for r in range(8)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 900
    while True:
        try:
            got = queue.get(timeout=2)
            break
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"a rank failed ({dead}) or no result in 900 s") from None
    for p in procs:
        p.join(timeout=120)
    return got


def _measure(model: list[str], steps: int, every: int, mode: str, output_dir: str, env: dict) -> dict:
    saves = ["checkpoint.interval=0"] if mode == "none" else [
        f"checkpoint.interval={every}", f"checkpoint.async_save={str(mode == 'async').lower()}"]  # fmt: skip
    got = _run([*model, *LAYOUT, f"train.steps={steps}", f"run.output_dir={output_dir}", *saves], env)
    history, ends = got["history"], got["ends"]
    # From the end of step 2 to the end of the run (the last save waited for): every save's
    # blocking and the slow-down of the steps it overlaps are inside.
    per_step = (got["returned"] - ends[1]) / (steps - 2)
    out = {
        "wall_s_per_step": round(per_step, 4),
        "mean_step_time_s": round(statistics.mean(m["step_time_s"] for m in history[2:]), 4),
    }
    if mode != "none":
        out["saves"] = [
            {"step": m["step"] + 1, **{k: round(m[k], 4) for k in ("blocked_s", "write_s", "save_s")}}
            for m in history
            if "save_s" in m
        ]
    print(mode, output_dir, json.dumps(out), flush=True)
    return out


def overlap(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3_server import s3_server

    from raytrain_hybrid.config import load_config

    model = [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}"]
    runs: dict = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        runs["none"] = _measure(model, args.steps, args.every, "none", f"{tmp}/none", {})
        for mode in ("sync", "async"):
            runs[f"local-{mode}"] = _measure(model, args.steps, args.every, mode, f"{tmp}/{mode}", {})
        with s3_server() as env:
            for mode in ("sync", "async"):
                runs[f"s3-{mode}"] = _measure(model, args.steps, args.every, mode, f"s3://bucket/{mode}", env)
    step = runs["none"]["wall_s_per_step"]
    summary = {}
    for name, r in runs.items():
        if name == "none":
            continue
        mid = r["saves"][:-1]  # the last one is waited for at the end of the run, whatever the mode
        n_saves = len(r["saves"])
        summary[name] = {
            "wall_s_per_step": r["wall_s_per_step"],
            "cost_per_save_s": round((r["wall_s_per_step"] - step) * (args.steps - 2) / n_saves, 4),
            "median_blocked_s": statistics.median(s["blocked_s"] for s in mid),
            "blocked_fraction_of_a_step": round(statistics.median(s["blocked_s"] for s in mid) / step, 4),
            "median_save_s": statistics.median(s["save_s"] for s in mid),
        }
    cfg = load_config(None, [*model, *LAYOUT])
    params = param_count(cfg)
    results = {
        "command": "cd <repo> && " + " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, 8 gloo processes (torch threads 1 each), no Ray",
        # Other work on the machine makes the step times noisy: the 1-minute load average around it.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "model": {"hidden_size": args.hidden, "num_layers": args.layers, "params": params, "state_bytes": params * 12},
        "layout": "dp=2 tp=2 pp=2, 1F1B, 4 micro-batches, zero=0",
        "steps": args.steps,
        "save_every": args.every,
        "note": "wall_s_per_step: end of step 2 to the end of the run, the last save's wait included; "
        "cost_per_save_s: (wall_s_per_step - no saves') * steps / saves; blocked_fraction_of_a_step: "
        "median blocked_s of the saves before the last over the step time without saves",
        "step_s_without_saves": step,
        "summary": summary,
        "runs": runs,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "checkpoint_async.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("step_s_without_saves", "summary")}, indent=2))


# ---------------------------------------------------------------- save-load: local Ray


def save_load(args) -> None:
    import ray

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.launch.runtime.driver import run

    model = [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "data.path=memory"]
    layout = LAYOUT
    ray.init(address="local", num_cpus=10, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "saved"
        sync = ["checkpoint.interval=2", "checkpoint.keep=0", "checkpoint.async_save=false"]  # save_s: all of a save
        cfg = load_config(
            None, [*model, *layout, "train.steps=6", *sync, f"run.output_dir={saved}", "run.progress=false"]
        )
        summary = run(cfg)
        step4 = saved / "checkpoints" / "step_4"
        manifest = json.loads((step4 / "manifest.json").read_text())
        sizes = {name: d["size"] for name, d in manifest["files"].items()}
        loads = {}
        for name, extra in (("2x2x2", layout), ("1x1x1", ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1",
                                                          "parallelism.microbatches=1"])):  # fmt: skip
            rcfg = load_config(None, [*model, *extra, "train.steps=6", f"run.output_dir={Path(tmp) / name}",
                                      "run.progress=false"])  # fmt: skip
            loads[name] = run(rcfg, resume=str(step4))["startup_s"]["checkpoint_load"]
    params = param_count(cfg)
    state_bytes = params * 12
    shard_sizes = [v for k, v in sizes.items() if k.endswith(".distcp")]
    steps = [c for c in summary["checkpoints"]]
    results = {
        "command": "cd <repo> && " + " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "model": {"hidden_size": args.hidden, "num_layers": args.layers, "params": params},
        "layout": "dp=2 tp=2 pp=2, 1F1B, 4 micro-batches, zero=0",
        "mean_step_time_s": summary["mean_step_time_s"],
        "save": [
            {"step": c["step"], "write_s": round(c["write_s"], 3), "save_s": round(c["save_s"], 3)} for c in steps
        ],
        "median_save_s": statistics.median(c["save_s"] for c in steps),
        "median_write_s": statistics.median(c["write_s"] for c in steps),
        "load_s": loads,
        "bytes_on_disk": sum(sizes.values()),
        "model_state_bytes": state_bytes,
        "disk_over_state": sum(sizes.values()) / state_bytes,
        "largest_rank_file_over_even_share": max(shard_sizes) / (sum(shard_sizes) / len(shard_sizes)),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "checkpoint.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("overlap", "save-load"), default="overlap")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="overlap: steps per run")
    ap.add_argument("--every", type=int, default=2, help="overlap: a checkpoint every this many steps")
    args = ap.parse_args()
    overlap(args) if args.part == "overlap" else save_load(args)


if __name__ == "__main__":
    main()
