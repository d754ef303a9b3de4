"""The expert-parallel compute on a GPU: ``torch._grouped_mm`` (Hopper, bf16) against the
per-expert loop the same function runs elsewhere, forward and backward, on uneven token
counts (an expert with none included); then both timed at one rank's share of Qwen3-30B-A3B
under ep = 8 (16 local experts, hidden 2048, expert width 768, 8 sequences of 4,096 tokens,
8 experts a token).

    python benchmarks/gpu_grouped_mm.py             # -> benchmarks/results/gpu_grouped_mm.json

Agreement is measured against the loop in fp32 on the same bf16-rounded inputs: the grouped
kernel's relative error should be bf16's own (the loop in bf16 is reported beside it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu_grouped_mm.json"


def experts(e: int, h: int, f: int, device, dtype=torch.float32) -> SimpleNamespace:
    g = torch.Generator(device="cpu").manual_seed(0)
    gate_up = (torch.randn(e, 2 * f, h, generator=g) / h**0.5).to(device, dtype).requires_grad_()
    down = (torch.randn(e, h, f, generator=g) / f**0.5).to(device, dtype).requires_grad_()
    return SimpleNamespace(gate_up_proj=gate_up, down_proj=down, act_fn=torch.nn.functional.silu)


CALLS = {"grouped_mm": 0}


def _counting(real):
    def grouped_mm(*args, **kwargs):
        CALLS["grouped_mm"] += 1
        return real(*args, **kwargs)

    return grouped_mm


def run(ex, x, counts, grouped: bool, weight: torch.Tensor):
    """Output and the gradients of x and both weights (of the loss sum(out * weight)), through
    expert_parallel._compute with the grouped kernel allowed or not."""
    from raytrain_hybrid.distributed import expert_parallel as ep

    keep = ep._grouped
    ep._grouped = (lambda _x: True) if grouped else (lambda _x: False)
    try:
        for p in (ex.gate_up_proj, ex.down_proj):
            p.grad = None
        x = x.detach().requires_grad_()
        out = ep._compute(ex, x, counts)
        (out * weight.to(out.dtype)).float().sum().backward()
        return [out.float(), x.grad.float(), ex.gate_up_proj.grad.float(), ex.down_proj.grad.float()]
    finally:
        ep._grouped = keep


def loss_weight(rows: int, h: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1)
    return torch.randn(rows, h, generator=g).to(device)


def rel(a, b) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def agreement(device) -> dict:
    e, h, f = 4, 256, 128
    counts = [37, 0, 200, 91]  # uneven, one expert idle
    g = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(sum(counts), h, generator=g).to(device, torch.bfloat16)
    ex16 = experts(e, h, f, device, torch.bfloat16)
    ex32 = SimpleNamespace(
        gate_up_proj=ex16.gate_up_proj.detach().float().requires_grad_(),
        down_proj=ex16.down_proj.detach().float().requires_grad_(),
        act_fn=ex16.act_fn,
    )
    w = loss_weight(sum(counts), h, device)
    exact = run(ex32, x.float(), counts, False, w)
    before = CALLS["grouped_mm"]
    grouped = run(ex16, x, counts, True, w)
    calls = CALLS["grouped_mm"] - before
    loop16 = run(ex16, x, counts, False, w)
    names = ["output", "grad_input", "grad_gate_up", "grad_down"]
    return {
        "experts": e,
        "hidden": h,
        "expert_width": f,
        "counts": counts,
        "grouped_mm_calls_forward": calls,  # 2: the grouped path ran (the loop makes none)
        "grouped_rel_err_vs_fp32_loop": {n: rel(a, b) for n, a, b in zip(names, grouped, exact, strict=True)},
        "bf16_loop_rel_err_vs_fp32_loop": {n: rel(a, b) for n, a, b in zip(names, loop16, exact, strict=True)},
        "grouped_rel_diff_vs_bf16_loop": {n: rel(a, b) for n, a, b in zip(names, grouped, loop16, strict=True)},
    }


def timing(device, steps: int) -> dict:
    e, h, f, k, tokens = 16, 2048, 768, 8, 8 * 4096
    pairs = tokens * k // 8  # the rank's share of token-expert pairs under ep = 8 (balanced)
    counts = [pairs // e] * e
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(pairs, h, generator=g).to(device, torch.bfloat16)
    ex = experts(e, h, f, device, torch.bfloat16)
    w = loss_weight(pairs, h, device)
    out = {"local_experts": e, "hidden": h, "expert_width": f, "rows": pairs}
    for name, grouped in (("grouped_mm", True), ("loop", False)):
        for _ in range(2):
            run(ex, x, counts, grouped, w)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            run(ex, x, counts, grouped, w)
        torch.cuda.synchronize(device)
        out[f"{name}_fwd_bwd_s"] = (time.perf_counter() - t0) / steps
    flops = 3 * 2 * pairs * (h * 2 * f + f * h)  # forward and backward (2x) of both matmuls
    for name in ("grouped_mm", "loop"):
        out[f"{name}_tflops"] = flops / out[f"{name}_fwd_bwd_s"] / 1e12
    out["loop_over_grouped"] = out["loop_fwd_bwd_s"] / out["grouped_mm_fwd_bwd_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")):
        print("gpu_grouped_mm: needs a CUDA device and torch._grouped_mm", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch._grouped_mm = _counting(torch._grouped_mm)
    result = {
        "command": "cd <repo> && python " + " ".join(["benchmarks/gpu_grouped_mm.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "agreement": agreement(device),
        "timing": timing(device, args.steps),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
