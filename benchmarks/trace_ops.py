"""Where a step's time goes, read off a run.profile_steps trace (Chrome/Perfetto JSON).

    python benchmarks/trace_ops.py runs/profiled/profile/trace_rank0.json [--top 15]

Per op name, its self time (its duration less the ops it called, on the same thread) summed over
the traced steps, as a share of the ``step <N>`` spans' total: the table Perfetto's "slice self
time" view gives, as data; the same summed by kind (matmuls, attention, collectives, waiting for
one, ...), with the time of the steps' own thread spent in no op at all (Python between ops). CPU
ops (``cpu_op``, on every thread: autograd's backward thread too, so shares may add up past 1)
and, on CUDA, GPU kernels (``kernel``: their own timeline, a share of the same steps' time) and
memory copies are counted apart. Standard library only, so it runs wherever the trace is.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
# Kinds of CPU op, by name (the first rule that matches): where a step's CPU time goes.
KINDS = (
    ("waiting for a collective", ("_c10d_functional::wait_tensor", "c10d::wait")),
    ("pipeline send/recv", ("c10d::send", "c10d::recv")),
    ("collectives", ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")),
    ("matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::linear")),
    ("attention", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash_attention")),
    ("optimizer", ("Optimizer.", "aten::_fused_adamw", "aten::_foreach_")),
    ("other aten ops", ("aten::",)),
)


def _self_times(events: list[dict]) -> dict[str, float]:
    """Self time per name of nested complete events of one thread, in microseconds."""
    totals: dict[str, float] = defaultdict(float)
    stack: list[list] = []  # [end, name, time spent in children]
    for ev in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start, end = ev["ts"], ev["ts"] + ev["dur"]
        while stack and stack[-1][0] <= start:
            done_end, name, children = stack.pop()
            totals[name] -= children
        if stack:
            stack[-1][2] += ev["dur"]
        totals[ev["name"]] += ev["dur"]
        stack.append([end, ev["name"], 0.0])
    while stack:
        _, name, children = stack.pop()
        totals[name] -= children
    return totals


def kind(name: str) -> str:
    """The kind of a CPU op (KINDS); the rest (DTensor's and autograd's Python, ...) is "other"."""
    return next((k for k, prefixes in KINDS if name.startswith(prefixes)), "other")


def _outside_ops(steps: list[dict], ops: list[dict]) -> float:
    """Time of the step spans in no CPU op of their own thread (Python between ops), in us."""
    covered = 0.0
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        inside = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in ops
            if (e.get("pid"), e.get("tid")) == (step.get("pid"), step.get("tid")) and lo <= e["ts"] < hi
        )
        end = lo
        for start, stop in inside:  # the union of the ops' intervals
            if stop > end:
                covered += stop - max(start, end)
                end = stop
    return sum(s["dur"] for s in steps) - covered


def read(path: str | Path, top: int = 15) -> dict:
    """Steps, step time, and the ``top`` ops by self time (CPU) and kernels (GPU) of one trace."""
    trace = json.loads(Path(path).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step ")]
    step_us = sum(e["dur"] for e in steps)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    gpu: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "cpu_op":
            by_thread[e.get("pid"), e.get("tid")].append(e)
        elif e.get("cat") in GPU_KINDS:
            gpu[e["name"]] += e["dur"]
    cpu: dict[str, float] = defaultdict(float)
    for thread_events in by_thread.values():
        for name, us in _self_times(thread_events).items():
            cpu[name] += us

    def ranked(totals: dict[str, float]) -> list[dict]:
        rows = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
        return [
            {"name": n, "self_ms": round(us / 1e3, 3), "share_of_steps": round(us / step_us, 4) if step_us else None}
            for n, us in rows
        ]

    kinds: dict[str, float] = defaultdict(float)
    for name, us in cpu.items():
        kinds[kind(name)] += us
    kinds["outside any op, on the step's thread"] = _outside_ops(steps, [e for e in events if e.get("cat") == "cpu_op"])
    return {
        "steps": sorted(int(e["name"].split()[1]) for e in steps),
        "step_ms": [round(e["dur"] / 1e3, 3) for e in sorted(steps, key=lambda e: e["ts"])],
        "cpu_ops_self_ms": round(sum(cpu.values()) / 1e3, 3),
        "top_cpu_ops": ranked(cpu),
        "cpu_by_kind": ranked(kinds),
        "gpu_busy_ms": round(sum(gpu.values()) / 1e3, 3),
        "top_gpu_kernels": ranked(gpu),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a profile/trace_rank<R>.json of run.profile_steps")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    print(json.dumps(read(args.trace, args.top), indent=1))


if __name__ == "__main__":
    main()
