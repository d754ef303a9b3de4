"""Layout search: every (dp, cp, tp, pp, micro-batches, schedule, ZeRO, hybrid sharding, recompute) that fits,
ranked."""

from __future__ import annotations

import dataclasses

from raytrain_hybrid.config import Config, validate
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.params import (
    has_sequence_parallel,
)
from raytrain_hybrid.planner.cost import (
    predict,
)
from raytrain_hybrid.planner.hardware import GiB, Hardware


def _microbatch_counts(per_replica: int) -> list[int]:
    """Micro-batches per replica: every divisor of the replica's batch, down to one sequence
    per micro-batch (the validator then drops counts a schedule refuses)."""
    return [d for d in range(1, per_replica + 1) if per_replica % d == 0]


def _replicates(dp: int, zero: int, inner: int, gpus_per_node: int) -> list[int]:
    """Hybrid sharding's candidates: 1 (shard over all of dp), and, where dp's groups leave a node
    (``inner`` = cp x tp workers a dp rank), the replicate that keeps each shard group inside one
    (none where a node holds one dp rank only: a shard group of one is zero=0's replication)."""
    if zero == 0 or dp * inner <= gpus_per_node:
        return [1]
    shard = max((d for d in range(1, dp + 1) if dp % d == 0 and d * inner <= gpus_per_node), default=1)
    return [1] if shard == 1 else [1, dp // shard]


def _candidates(world: int, cfg: Config, gpus_per_node: int, fixed: dict):
    def allowed(key, values):
        return [v for v in values if key not in fixed or fixed[key] == v]

    divisors = [d for d in range(1, world + 1) if world % d == 0]
    has_sp = has_sequence_parallel(cfg.model)
    # Context parallelism where the model has a cp attention and a sequence to split (the
    # validator refuses the rest): it costs all-to-alls, so it wins where memory needs it.
    cps = [d for d in divisors if d > 1 and cfg.model.seq_len % d == 0] if get_arch(cfg.model.arch).attention else []
    # Expert parallelism for mixtures of experts: ep among dp's divisors that divide the experts.
    moe = get_arch(cfg.model.arch).moe is not None
    experts = get_arch(cfg.model.arch).experts(cfg.model)[0] if moe else 1
    for tp in allowed("tp", [d for d in divisors if d <= gpus_per_node]):
        for pp, cp in ((p, c) for p in divisors for c in allowed("cp", [1, *cps]) if (world // tp) % (p * c) == 0):
            if "pp" in fixed and fixed["pp"] != pp:
                continue
            dp = world // (tp * pp * cp)
            if "dp" in fixed and fixed["dp"] != dp or cfg.train.global_batch_size % dp:
                continue
            schedules = ["1F1B"] if pp == 1 else ["GPipe", "1F1B", "Interleaved1F1B"]
            eps = [e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0] if moe else [1]
            for schedule, ep in ((s, e) for s in allowed("schedule", schedules) for e in allowed("ep", eps)):
                for mb in allowed("microbatches", _microbatch_counts(cfg.train.global_batch_size // dp)):
                    zeros = allowed("zero", [0] if dp * cp == 1 else [0, 1, 2, 3])
                    for zero, rep in (
                        (z, r) for z in zeros for r in allowed("replicate", _replicates(dp, z, cp * tp, gpus_per_node))
                    ):
                        for ac in allowed("activation_checkpointing", [False, True]):
                            for sp in allowed("sequence_parallel", [True, False] if tp > 1 and has_sp else [False]):
                                yield {
                                    "dp": dp,
                                    "tp": tp,
                                    "pp": pp,
                                    "cp": cp,
                                    "ep": ep,
                                    "schedule": schedule,
                                    "microbatches": mb,
                                    "zero": zero,
                                    "replicate": rep,
                                    "activation_checkpointing": ac,
                                    "sequence_parallel": sp,
                                }


def plan(cfg: Config, world: int, hw: Hardware, fixed: dict | None = None) -> list[dict]:
    """Every layout of ``world`` ranks the validator accepts, best predicted tokens/s first,
    infeasible (out of memory) last with the reason. ``fixed`` pins layout keys (e.g. a
    published run's dp, tp, pp) and searches the rest."""
    out = []
    for layout in _candidates(world, cfg, hw.gpus_per_node, fixed or {}):
        par = dataclasses.replace(cfg.parallelism, **layout, virtual_stages=0)
        cluster = dataclasses.replace(cfg.cluster, gpus_per_node=hw.gpus_per_node)
        candidate = dataclasses.replace(cfg, parallelism=par, cluster=cluster)
        try:
            validate(candidate)
        except ConfigError:
            continue
        pred = predict(candidate, hw)
        need = pred["memory_bytes"]["total"]
        feasible = need <= hw.memory_bytes
        reason = "" if feasible else f"needs {need / GiB:.1f} GiB per rank > {hw.memory_bytes / GiB:.1f} GiB"
        out.append({**layout, "feasible": feasible, "reason": reason, **pred})
    out.sort(key=lambda r: (not r["feasible"], -r["predicted_tokens_per_s"], r["memory_bytes"]["total"]))
    return out


def describe(cfg: Config, hw: Hardware) -> str:
    """One line of the planner's view of a config's own layout (what jobs/ quote in a comment)."""
    pred = predict(cfg, hw)
    need = pred["memory_bytes"]["total"]
    fits = "fits" if need <= hw.memory_bytes else "DOES NOT FIT"
    return (
        f"{hw.name}, {cfg.parallelism.world_size} ranks: {need / GiB:.1f} GiB/rank of "
        f"{hw.memory_bytes / GiB:.1f} ({fits}), {pred['predicted_tokens_per_s']:,.0f} tokens/s, "
        f"MFU {pred['predicted_mfu']:.1%}, bubble {pred['bubble_fraction']:.1%}"
    )


def format_table(rows: list[dict]) -> str:
    """Planner rows as the fixed-width table ``plan`` prints."""
    lines = [
        f"{'dp':>4} {'cp':>3} {'tp':>3} {'pp':>3} {'schedule':>16} {'mb':>4} {'zero':>4} {'ac':>3} {'sp':>3} "
        f"{'GiB/rank':>9} {'tokens/s':>12} {'MFU':>6} {'bubble':>6}  note"
    ]
    for r in rows:
        lines.append(
            f"{r['dp']:>4} {r['cp']:>3} {r['tp']:>3} {r['pp']:>3} {r['schedule']:>16} "
            f"{r['microbatches']:>4} {r['zero']:>4} "
            f"{'y' if r['activation_checkpointing'] else 'n':>3} {'y' if r['sequence_parallel'] else 'n':>3} "
            f"{r['memory_bytes']['total'] / GiB:>9.2f} "
            f"{r['predicted_tokens_per_s']:>12,.0f} {r['predicted_mfu']:>6.1%} {r['bubble_fraction']:>6.1%}  "
            f"{'ep=' + str(r['ep']) + ' ' if r.get('ep', 1) > 1 else ''}"
            f"{'replicate=' + str(r['replicate']) + ' ' if r.get('replicate', 1) > 1 else ''}{r['reason']}"
        )
    return "\n".join(lines)
