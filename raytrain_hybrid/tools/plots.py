"""Pictures for notebooks and reports: pipeline schedules, per-rank memory, sweeps, losses.

Multi-stage schedules are drawn from PyTorch's own action order (the list each rank
executes, from ``torch.distributed.pipelining``); GPipe and 1F1B are written out. Both are
timed here with unit costs: forward 1, full backward 2, input-grad and weight-grad halves
1 each. An action starts when its rank is free and its inputs exist (the previous stage's
forward, the next stage's backward), so idle slots are the bubble the schedule really has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
_COLOR = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


@dataclass(frozen=True)
class Block:
    rank: int
    stage: int
    kind: str  # F, B, I (input grad), W (weight grad)
    microbatch: int
    start: float
    end: float


_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _timed(action) -> bool:
    return action is not None and action.computation_type.name in _KINDS


def _inputs(stage: int, kind: str, mb: int, last: int) -> list[list[tuple[int, str, int]]]:
    """What an action waits for: a list of inputs, each met by any one of its alternatives."""
    if kind == "F":
        return [[(stage - 1, "F", mb)]] if stage > 0 else []
    if kind == "W":
        return [[(stage, "I", mb)]]
    waits = [[(stage, "F", mb)]]
    if stage < last:  # the gradient from the next stage: its full backward or its input half
        waits.append([(stage + 1, "B", mb), (stage + 1, "I", mb)])
    return waits


def _single_stage_orders(schedule: str, pp: int, m: int) -> list[list[tuple[int, str, int]]]:
    """GPipe and 1F1B, written out: torch 2.13's ``pipeline_order`` of its single-stage
    schedules shifts the last rank's micro-batch indices by one (a display-only table)."""
    orders = []
    for r in range(pp):
        if schedule == "GPipe":
            orders.append([(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)])
            continue
        warmup = min(pp - 1 - r, m)
        order = [(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            order += [(r, "F", warmup + i), (r, "B", i)]
        order += [(r, "B", i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _schedule_orders(schedule: str, pp: int, microbatches: int, virtual: int) -> list[list[tuple[int, str, int]]]:
    """Per rank, the (stage, kind, micro-batch) actions it runs, in order."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from raytrain_hybrid.config import SCHEDULES, SINGLE_STAGE_SCHEDULES

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    if schedule in SINGLE_STAGE_SCHEDULES:
        return _single_stage_orders(schedule, pp, microbatches)
    # DualPipeV pairs one stage's forward with another's backward in one action (overlapped on
    # GPUs); timed here as its two parts in order.
    return [
        [
            (a.stage_index, _KINDS[a.computation_type.name], a.microbatch_index)
            for action in order
            for a in (action.sub_actions or (action,) if action is not None else ())
            if _timed(a)
        ]
        for order in get_schedule_ops(schedule, pp, microbatches, virtual)
    ]


def schedule_timeline(schedule: str, pp: int, microbatches: int, virtual: int = 2) -> tuple[list[Block], float]:
    """Timed blocks of one step of ``schedule`` and its bubble fraction (idle share of rank time)."""
    actions = _schedule_orders(schedule, pp, microbatches, virtual)
    last = max(s for acts in actions for s, _, _ in acts)
    scale = pp / (last + 1)  # a rank's chunks together cost one stage's work: schedules compare
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * pp
    nxt = [0] * pp
    blocks: list[Block] = []

    def ready(stage: int, kind: str, mb: int) -> float | None:
        """When the inputs of an action exist; None while one is missing."""
        times = []
        for alternatives in _inputs(stage, kind, mb, last):
            got = [done[d] for d in alternatives if d in done]
            if not got:
                return None
            times.append(min(got))
        return max(times, default=0.0)

    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for rank in range(pp):
            while nxt[rank] < len(actions[rank]):
                stage, kind, mb = actions[rank][nxt[rank]]
                t = ready(stage, kind, mb)
                if t is None:
                    break
                start = max(free[rank], t)
                end = start + _COST[kind] * scale
                done[(stage, kind, mb)] = end
                blocks.append(Block(rank, stage, kind, mb, start, end))
                free[rank] = end
                nxt[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule}: the action order deadlocks (pp={pp}, microbatches={microbatches})")
    makespan = max(b.end for b in blocks)
    busy = sum(b.end - b.start for b in blocks)
    return blocks, 1.0 - busy / (pp * makespan)


def plot_schedules(schedules: list[str], pp: int, microbatches: int, virtual: int = 2):
    """One timeline per schedule (ranks as rows), titled with its bubble fraction."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(schedules), 1, figsize=(11, 1.2 + 0.55 * pp * len(schedules)), squeeze=False)
    for ax, name in zip(axes[:, 0], schedules, strict=True):
        blocks, bubble = schedule_timeline(name, pp, microbatches, virtual)
        for b in blocks:
            ax.barh(b.rank, b.end - b.start, left=b.start, color=_COLOR[b.kind], edgecolor="white", height=0.8)
            ax.text((b.start + b.end) / 2, b.rank, str(b.microbatch), ha="center", va="center", fontsize=6, color="w")
        ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
        ax.invert_yaxis()
        ax.set_title(f"{name}: pp={pp}, {microbatches} micro-batches, bubble {bubble:.1%}", fontsize=9)
    axes[-1, 0].set_xlabel("time (one rank's forward of one micro-batch = 1 unit)")
    fig.legend(
        handles=[Patch(color=c, label=k) for k, c in _COLOR.items()],
        labels=["forward", "backward", "backward (input)", "backward (weight)"],
        loc="lower center",
        ncol=4,
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def plot_memory(rows: list[dict], top: int = 12):
    """Stacked per-rank memory (parameters, gradients, optimizer, activations) of planner rows."""
    import matplotlib.pyplot as plt

    from raytrain_hybrid.planner.hardware import GiB

    rows = rows[:top]
    labels = [
        f"{r['dp']}x{r['tp']}x{r['pp']} z{r['zero']} m{r['microbatches']}"
        + (" ac" if r["activation_checkpointing"] else "")
        + (" sp" if r.get("sequence_parallel") else "")
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)), 4))
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer", "activations"):
        values = [r["memory_bytes"][part] / GiB for r in rows]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("GiB per rank")
    ax.set_title("per-rank memory by layout (dp x tp x pp, ZeRO stage, micro-batches)")
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_sweep(rows: list[dict]):
    """Measured against predicted tokens/s of a sweep's trials (sweep.json rows)."""
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r["failed"]]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter([r["predicted_tokens_per_s"] for r in ok], [r["measured_tokens_per_s"] for r in ok])
    for r in ok:
        ax.annotate(r["name"], (r["predicted_tokens_per_s"], r["measured_tokens_per_s"]), fontsize=6)
    ax.set_xlabel("predicted tokens/s")
    ax.set_ylabel("measured tokens/s")
    ax.set_title("layout sweep: measured vs predicted throughput")
    fig.tight_layout()
    return fig


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def plot_loss(run_dir: str | Path):
    """Loss and tokens/s per step of a run directory."""
    import matplotlib.pyplot as plt

    history = read_metrics(run_dir)
    steps = [h["step"] + 1 for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(steps, [h["loss"] for h in history], marker="o")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    b.plot(steps, [h["tokens_per_s"] for h in history], marker="o", color="tab:green")
    b.set_xlabel("step")
    b.set_ylabel("tokens/s")
    fig.tight_layout()
    return fig
