"""GPU benchmark without Ray (issue 21.4): the trainer's worker loop against a plain PyTorch loop
over the same transformers Llama, eager and compiled, on whatever GPUs this machine has.

    python benchmarks/bench_gpu.py                      # -> benchmarks/results/gpu.json
    python benchmarks/bench_gpu.py --shapes 0.77b --steps 20
    python benchmarks/bench_gpu.py --smoke --out /tmp/gpu_smoke.json   # CPU, tiny, seconds
    python benchmarks/bench_gpu.py --fp8-loss-steps 200 --out benchmarks/results/gpu_fp8_loss.json

One process per visible GPU (torch.multiprocessing, NCCL): the engine runs at dp = GPUs,
tp = pp = 1 ((1,1,1) on one GPU), each rank with its own batch of the shape's rows, through
``engine.worker.run_worker`` (what Ray Train's workers call), in-memory corpus, bf16 autocast.
Engine variants: compile off, compile on, compile on with selective activation checkpointing,
and with train.fp8 rowwise eager (``engine_eager_fp8``) and compiled (``engine_compiled_fp8``) and
tensorwise compiled, where the GPU has float8 matmuls (compute capability >= 8.9) and torchao is
installed.
Rank 0 then runs the plain loop (transformers LlamaForCausalLM, cross-entropy, clip, fused
AdamW, bf16 autocast) on the same shape, eager and under ``torch.compile``. Each case reports
the median step time after warm-up, tokens/s (all ranks), MFU (the engine's FLOP accounting),
peak allocated memory, and the ratios the issue's goals name.

``--fp8-loss-steps N`` runs only FP8's loss check instead: a 0.1B Llama (8 layers, hidden 1024,
seq 1024, batch 8) trains N
steps compiled on the shipped corpus (real text, the tokenizer the package ships) in bf16 and with
train.fp8 rowwise from the same seed; it records both loss curves and the relative difference of
their last 10 steps' mean loss (the issue's goal: within 1 % after 200 steps).

``--smoke`` runs the same code on the CPU with gloo, tiny shapes and 3 steps, and compiles
with dynamo's eager backend (no inductor code generation: a cold C++ compile costs ~20 s of
a CPU here); it exists so that tests/test_bench_gpu.py keeps this script working.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(__file__).resolve().parent / "results" / "gpu.json"
# The shapes: a 0.77B Llama, and four layers of an 8B-class model (GQA in both).
SHAPES = {
    "0.77b": dict(num_layers=16, hidden_size=2048, num_heads=16, num_kv_heads=8, ffn_hidden_size=5632, batch=8),
    "8b-layers": dict(num_layers=4, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, batch=4),
    "0.1b": dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=8, ffn_hidden_size=2816, batch=8),
    "smoke": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=192, batch=4),
}
SEQ = {"0.77b": 2048, "8b-layers": 2048, "0.1b": 1024, "smoke": 32}
ENGINE_VARIANTS = {
    "engine_eager": ["parallelism.compile=false"],
    "engine_compiled": ["parallelism.compile=true"],
    "engine_compiled_selective_ac": ["parallelism.compile=true", "parallelism.activation_checkpointing=selective"],
}
# train.fp8 (torchao's float8 linears in the blocks), compiled: on GPUs of compute capability >= 8.9;
# --smoke runs them emulated on the CPU.
FP8_VARIANTS = {
    "engine_eager_fp8": ["parallelism.compile=false", "train.fp8=rowwise"],
    "engine_compiled_fp8": ["parallelism.compile=true", "train.fp8=rowwise"],
    "engine_compiled_fp8_tensorwise": ["parallelism.compile=true", "train.fp8=tensorwise"],
}


def fp8_skipped(device: torch.device) -> str | None:
    """Why this machine runs no FP8 case (None: it runs them)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has compute capability below 8.9"
    return None


def variants(device: torch.device, only: list[str] | None = None) -> dict[str, list[str]]:
    out = dict(ENGINE_VARIANTS)
    if fp8_skipped(device) is None:
        emulate = [] if device.type == "cuda" else ["train.fp8_emulate=true"]
        out.update({name: [*sets, *emulate] for name, sets in FP8_VARIANTS.items()})
    return {name: sets for name, sets in out.items() if not only or name in only}


def overrides(shape: str, world: int, steps: int, dtype: str) -> list[str]:
    s = SHAPES[shape]
    model = [f"model.{k}={v}" for k, v in s.items() if k != "batch"]
    layout = [f"parallelism.dp={world}", "parallelism.tp=1", "parallelism.pp=1", "parallelism.microbatches=1"]
    return [
        "model.arch=llama",
        *model,
        f"model.seq_len={SEQ[shape]}",
        *layout,
        f"train.global_batch_size={s['batch'] * world}",
        f"train.steps={steps}",
        f"train.dtype={dtype}",
        "train.warmup_steps=2",
        "data.path=memory",
        "checkpoint.interval=0",
    ]


def _median_after(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup else times)


def engine_case(args, shape: str, variant: str, world: int, device: torch.device) -> dict:
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
    from raytrain_hybrid.engine.worker import run_worker

    cfg = load_config(None, [*overrides(shape, world, args.steps, args.dtype), *variants(device)[variant]])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    result = run_worker(WorkerPlan(cfg, use_gpu=device.type == "cuda"), "node0", WorkerIO(device=device))
    history, memory = result["history"], result["memory"]
    step_s = _median_after([h["step_time_s"] for h in history], args.warmup)
    states = max(m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"] for m in memory)
    peak = max((m.get("max_cuda_allocated_bytes") or 0) for m in memory) or None
    mfus = [h["mfu"] for h in history[args.warmup :] if h.get("mfu") is not None]
    return {
        "step_s": step_s,
        "tokens_per_s": cfg.train.global_batch_size * cfg.model.seq_len / step_s,
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_bytes": peak,
        "state_bytes": states,  # parameters, gradients, AdamW moments of the largest rank
        "activation_bytes": (peak - states) if peak else None,  # what the peak holds beyond the states
        "first_step_s": history[0]["step_time_s"],
        "compile_s": history[0].get("compile_s"),
        "recompiles_after_first_step": sum(h.get("compiles", 0) for h in history[1:]),
        "final_loss": history[-1]["loss"],
        "wall_s": time.perf_counter() - t0,
    }


def plain_case(args, shape: str, compiled: bool, device: torch.device) -> dict:
    """The same model and shapes in one process, no package code in the step: what a user
    writes by hand (transformers forward, loss, backward, clip, AdamW)."""
    import torch.nn.functional as F

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.models import get_arch
    from raytrain_hybrid.models.flops import device_peak_tflops, flops_per_token

    cfg = load_config(None, overrides(shape, 1, args.steps, args.dtype))
    m = cfg.model
    spec = get_arch(m.arch)  # the transformers class and config the trainer builds from the same keys
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = spec.hf_class(spec.hf_config(cfg)).to(device)
    forward = args.compile(model) if compiled else model
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    batch = SHAPES[shape]["batch"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        with autocast:
            logits = forward(input_ids=x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    step_s = _median_after(times, args.warmup)
    tokens_per_s = batch * m.seq_len / step_s
    peak_tflops = device_peak_tflops(device)
    mfu = flops_per_token(m) * tokens_per_s / 1e12 / peak_tflops if peak_tflops else None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_s": step_s, "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_bytes": peak, "final_loss": loss_value}


def fp8_loss_case(args, world: int, device: torch.device) -> dict:
    """bf16 and FP8 rowwise, both compiled, N steps from one seed on the shipped corpus."""
    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.engine.plan import WorkerIO, WorkerPlan
    from raytrain_hybrid.engine.worker import run_worker

    shape, steps, tail = ("smoke" if args.smoke else "0.1b"), args.fp8_loss_steps, 10
    emulate = [] if device.type == "cuda" else ["train.fp8_emulate=true"]
    out = {"shape": shape, "seq_len": SEQ[shape], "steps": steps, "data": "data.path=memory (the shipped corpus.txt)"}
    base = [*overrides(shape, world, steps, args.dtype), "parallelism.compile=true"]
    for name, sets in (("bf16", []), ("fp8_rowwise", ["train.fp8=rowwise", *emulate])):
        cfg = load_config(None, [*base, *sets])
        t0 = time.perf_counter()
        plan = WorkerPlan(cfg, use_gpu=device.type == "cuda")
        history = run_worker(plan, "node0", WorkerIO(device=device))["history"]
        losses = [h["loss"] for h in history]
        if len(losses) != steps:
            raise RuntimeError(f"{name}: {len(losses)} steps recorded, {steps} asked for")
        out[name] = {
            "losses_every_10": losses[::10] + [losses[-1]],
            "last_mean": statistics.fmean(losses[-tail:]),
            "step_s": _median_after([h["step_time_s"] for h in history], args.warmup),
            "wall_s": time.perf_counter() - t0,
        }
    out["last_mean_rel_diff"] = abs(out["fp8_rowwise"]["last_mean"] / out["bf16"]["last_mean"] - 1)
    out["goal_rel_diff"] = 0.01
    out["ok"] = out["last_mean_rel_diff"] <= out["goal_rel_diff"]
    return out


def ratios(row: dict, world: int) -> dict:
    """The issue's goals as numbers (engine per GPU against the one-GPU plain loop)."""
    out = {}

    def per_gpu(case):
        return row[case]["step_s"]  # each rank steps its own batch of the shape's rows

    if "plain_compiled" in row and "engine_compiled" in row:
        out["engine_compiled_over_plain_compiled_step"] = per_gpu("engine_compiled") / row["plain_compiled"]["step_s"]
    if "plain_compiled" in row and "plain_eager" in row:
        out["plain_compiled_over_plain_eager_step"] = row["plain_compiled"]["step_s"] / row["plain_eager"]["step_s"]
    if "plain_eager" in row and "engine_eager" in row:
        out["engine_eager_over_plain_eager_step"] = per_gpu("engine_eager") / row["plain_eager"]["step_s"]
    if "engine_eager" in row and "engine_compiled" in row:
        out["engine_compiled_over_engine_eager_step"] = per_gpu("engine_compiled") / per_gpu("engine_eager")
    sac, full = row.get("engine_compiled_selective_ac"), row.get("engine_compiled")
    if sac and full:
        out["selective_ac_over_no_ac_step"] = sac["step_s"] / full["step_s"]
    for name in FP8_VARIANTS:  # the goal: FP8 / bf16 step time, both compiled, <= 0.80
        bf16 = "engine_eager" if name.startswith("engine_eager") else "engine_compiled"
        if name in row and bf16 in row:
            out[f"{name}_over_{bf16}_step"] = row[name]["step_s"] / row[bf16]["step_s"]
            out[f"{name}_final_loss_rel_diff"] = abs(row[name]["final_loss"] / row[bf16]["final_loss"] - 1)
    if sac and full and sac.get("activation_bytes") and full.get("activation_bytes"):
        out["selective_ac_activation_memory_saved"] = 1 - sac["activation_bytes"] / full["activation_bytes"]
    return out


def rank_main(rank: int, world: int, args, port: int) -> None:
    """One spawned process per GPU: join the group, run, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    run_rank(rank, world, args)
    dist.destroy_process_group()


def run_rank(rank: int, world: int, args) -> dict | None:
    """Every case on this rank of an initialised process group; rank 0 writes args.out."""
    if args.smoke:
        # dynamo's eager backend: the compile path runs (per-block compile, counting), no inductor.
        torch.compile = functools.partial(torch.compile, backend="eager")
    args.compile = torch.compile
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results = {}
    if args.fp8_loss_steps:
        if fp8_skipped(device):
            raise SystemExit(f"bench_gpu: --fp8-loss-steps runs no FP8 here: {fp8_skipped(device)}")
        results["fp8_loss"] = fp8_loss_case(args, world, device)
        return write(args, results, world, device) if rank == 0 else None
    for shape in args.shapes:
        row = {name: engine_case(args, shape, name, world, device) for name in variants(device, args.variants)}
        if fp8_skipped(device):
            row["fp8_not_run"] = fp8_skipped(device)
        dist.barrier()
        if rank == 0:
            if not args.no_plain:  # the plain loop is one process on one GPU
                row["plain_eager"] = plain_case(args, shape, False, device)
                row["plain_compiled"] = plain_case(args, shape, True, device)
            row["ratios"] = ratios(row, world)
            results[shape] = {"model": SHAPES[shape], "seq_len": SEQ[shape], **row}
            print(json.dumps({shape: row}, indent=1), flush=True)
            write(args, results, world, device)  # each shape as it ends: a run cut short keeps them
        dist.barrier()
    return write(args, results, world, device) if rank == 0 else None


def write(args, results: dict, world: int, device: torch.device) -> dict:
    out = {
        "command": "cd <repo> && " + " ".join(["PYTHONPATH=. python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "gpus": world if device.type == "cuda" else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": args.dtype,
        "steps": args.fp8_loss_steps or args.steps,
        "warmup": args.warmup,
        "layout": {"dp": world, "tp": 1, "pp": 1},
        **({"fp8_loss": results["fp8_loss"]} if "fp8_loss" in results else {"shapes": results}),
        "smoke": args.smoke,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0.77b,8b-layers", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--variants",
        default="",
        help=f"comma-separated, only these engine cases, of {[*ENGINE_VARIANTS, *FP8_VARIANTS]}",
    )
    parser.add_argument("--no-plain", action="store_true", help="leave out the plain loop")
    parser.add_argument("--fp8-loss-steps", type=int, default=0, help="only FP8's loss check, this many steps")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shape, 3 steps (a test of the script)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.steps, args.warmup, args.dtype = "smoke", 3, 1, "float32"
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - {*ENGINE_VARIANTS, *FP8_VARIANTS}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = torch.cuda.device_count() if torch.cuda.is_available() and not args.smoke else 1
    port = free_port()
    if world == 1:  # no second process to start: run in this one
        rank_main(0, 1, args, port)
    else:
        torch.multiprocessing.spawn(rank_main, args=(world, args, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
