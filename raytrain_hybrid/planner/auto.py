"""parallelism.layout = "auto": the planner's layout for the nodes a cluster has now.

Every layout trains the same model for a fixed global batch (the rows of a step, their order and
the LR schedule do not depend on it) and checkpoints reshard across layouts, so the planner may
pick any: its pick changes the speed, never the losses. The search: every worker count the nodes
hold with each TP group inside one node, dp at most parallelism.dp (the run's bound), each layout
the validator accepts priced by the cost model (planner.search.plan); the fastest predicted one
that fits in memory wins, and the runner-up is said with the reason it lost.
"""

from __future__ import annotations

import dataclasses
import os

from raytrain_hybrid.config import Config
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.planner.hardware import PROFILES, GiB, Hardware, load_hardware
from raytrain_hybrid.planner.search import plan

# Another profile to price on: a built-in name (h100, a100-80, ...) or a `calibrate` file.
HARDWARE_ENV = "RAYTRAIN_HYBRID_HARDWARE"
_BY_ACCELERATOR = {"H100": "h100", "A100": "a100-80"}  # Ray's accelerator_type:<name> resource


def hardware_for(nodes: list[dict[str, float]], use_gpu: bool, slots: list[int]) -> Hardware:
    """The profile the pick is priced on: $RAYTRAIN_HYBRID_HARDWARE, else the nodes' GPU type
    (H100 when Ray does not say), else a rough CPU profile (calibrate for a better one)."""
    top = max(slots, default=1)
    if os.environ.get(HARDWARE_ENV):
        hw = load_hardware(os.environ[HARDWARE_ENV])
    elif use_gpu:
        types = {k.split(":", 1)[1] for n in nodes for k in n if k.startswith("accelerator_type:")}
        hw = PROFILES[next((_BY_ACCELERATOR[t] for t in sorted(types) if t in _BY_ACCELERATOR), "h100")]
    else:  # logical CPUs share the driver machine's cores: more ranks than cores gain nothing
        memory = sum(n.get("memory", 0) for n in nodes) / max(sum(slots), 1)  # Ray's memory, a worker's share
        hw = Hardware(
            name="CPU (uncalibrated)",
            gpus_per_node=top,
            memory_bytes=memory or 4 * GiB,
            peak_tflops=0.05,
            efficiency=0.5,
            intra_node_gbps=2.0,
            inter_node_gbps=1.0,
            latency_s=50e-6,
            cores=os.cpu_count() or 1,
            tp_pair_overhead_s=0.002,
        )
    return dataclasses.replace(hw, gpus_per_node=top)


def _fits(slots: list[int], tp: int, world: int) -> bool:
    """The nodes hold ``world`` workers with every TP group of ``tp`` inside one node."""
    return sum(n - n % tp for n in slots) >= world


def rank_layouts(cfg: Config, slots: list[int], hw: Hardware, worlds: list[int] | None = None) -> list[dict]:
    """Every feasible layout for nodes holding ``slots`` workers each (of ``worlds`` workers in
    all, default any count they hold), dp at most parallelism.dp, best first."""
    rows = []
    for world in worlds or range(1, sum(slots) + 1):
        for row in plan(cfg, world, hw):
            if row["feasible"] and row["dp"] <= cfg.parallelism.dp and _fits(slots, row["tp"], world):
                rows.append({**row, "world": world})
    # Context parallelism where no layout without it fits (a long sequence): its all-to-alls cost
    # little in the model, so it could win by a hair over tp or dp where neither needs it.
    if any(r["cp"] == 1 for r in rows):
        rows = [r for r in rows if r["cp"] == 1]
    # Ties (within 0.1 %, e.g. a tiny model's micro-batch counts) go to the simpler layout: fewer
    # workers, less sharding and recompute, fewer pipeline stages and micro-batches.
    rows.sort(
        key=lambda r: (
            -float(f"{r['predicted_tokens_per_s']:.3g}"),
            r["world"],
            r["cp"],  # (context parallelism only where it is faster)
            r["zero"],
            r.get("replicate", 1),
            bool(r["activation_checkpointing"]),
            r["pp"],
            r["tp"],
            r["microbatches"],
        )
    )
    return rows


def runner_up(rows: list[dict]) -> dict | None:
    """The best layout of another (dp, tp, pp) than the pick's, else the next one."""
    shape = [(r["dp"], r["cp"], r["tp"], r["pp"]) for r in rows]
    other = [r for r, s in zip(rows, shape, strict=True) if s != shape[0]]
    return other[0] if other else (rows[1] if len(rows) > 1 else None)


def layout_text(row: dict) -> str:
    ac, cp = row["activation_checkpointing"], f" cp={row['cp']}" if row["cp"] > 1 else ""
    cp += f" ep={row['ep']}" if row.get("ep", 1) > 1 else ""
    zero = f"zero={row['zero']}" + (f" replicate={row['replicate']}" if row.get("replicate", 1) > 1 else "")
    return (
        f"dp={row['dp']}{cp} tp={row['tp']} pp={row['pp']} {row['schedule']} microbatches={row['microbatches']} "
        f"{zero} activation_checkpointing={str(ac).lower()}"
    )


def _costs(row: dict) -> dict[str, float]:
    """Seconds of the predicted step by cause (cost.predict's step time, taken apart)."""
    t, bubble = row["time_s"], row["bubble_fraction"]
    busy = t["compute"] + t["tp"] + t["cp"] + t.get("ep", 0.0) + t["pp"]
    return {
        "compute (incl. recompute)": t["compute"],
        "tensor-parallel all-reduces": t["tp"],
        "context-parallel all-to-alls": t["cp"],
        "expert-parallel all-to-alls": t.get("ep", 0.0),
        "pipeline transfers": t["pp"],
        "pipeline bubble": busy * bubble / (1 - bubble) if bubble < 1 else 0.0,
        "gradient reduction left exposed": t["dp_exposed"],
    }


def why(best: dict, other: dict | None) -> str:
    if other is None:
        return "the only layout that fits"
    slower = 1 - other["predicted_tokens_per_s"] / best["predicted_tokens_per_s"]
    text = f"runner-up {layout_text(other)}: {other['predicted_tokens_per_s']:,.0f} tokens/s"
    if slower < 1e-3:
        return f"{text}, as fast; the pick is the simpler layout (fewer workers, stages, shards)"
    a, b = _costs(best), _costs(other)
    cause = max(a, key=lambda k: b[k] - a[k])
    return f"{text}, {slower:.0%} slower (most of it {cause}: {b[cause]:.3g} s a step vs {a[cause]:.3g} s)"


_PICKED = (
    *("dp", "cp", "ep", "tp", "pp", "microbatches", "schedule", "zero", "replicate"),
    *("activation_checkpointing", "sequence_parallel"),
)


def _at(cfg: Config, row: dict) -> Config:
    par = dataclasses.replace(cfg.parallelism, **{k: row[k] for k in _PICKED}, virtual_stages=0)
    return dataclasses.replace(cfg, parallelism=par)


def _said(rows: list[dict], where: str) -> list[str]:
    best = rows[0]
    return [
        f"layout auto: {layout_text(best)} {where}: {best['predicted_tokens_per_s']:,.0f} tokens/s predicted, "
        f"{best['memory_bytes']['total'] / GiB:.2f} GiB a rank",
        f"layout auto: {why(best, runner_up(rows))}",
    ]


def pick(cfg: Config, slots: list[int], hw: Hardware) -> tuple[Config, list[str]]:
    """The config at the best layout for nodes of ``slots`` workers, and the lines that say why."""
    rows = rank_layouts(cfg, [s for s in slots if s], hw)
    if not rows:
        raise ConfigError(
            "parallelism.layout",
            "auto",
            f"no layout of at most dp={cfg.parallelism.dp} fits nodes holding {slots} workers each on {hw.name} "
            "(memory, TP inside a node, the global batch); add nodes or GPUs, raise parallelism.dp, or set "
            "parallelism.layout=fixed with a layout",
        )
    return _at(cfg, rows[0]), _said(rows, f"on nodes holding {slots} workers ({hw.name})")


def pick_for_group(cfg: Config, slots: list[int], hw: Hardware) -> tuple[Config, list[str]] | None:
    """An elastic run's start with layout=auto: the best layout that uses every one of the
    group's workers (``slots`` a node, TP groups inside one), any dp up to their count, as a
    fixed layout (min_dp 0); None when the planner finds none that fits in memory."""
    world, slots = sum(slots), sorted((s for s in slots if s), reverse=True)
    hw = dataclasses.replace(hw, gpus_per_node=slots[0])  # TP's bound: the fullest node of this group
    bound = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, dp=world, min_dp=0))
    rows = rank_layouts(bound, slots, hw, worlds=[world])
    if not rows:
        return None
    return _at(bound, rows[0]), _said(rows, f"for the {world} workers started on nodes holding {slots} ({hw.name})")
