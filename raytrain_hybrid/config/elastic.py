"""Elastic data parallelism (parallelism.min_dp): the dp values a run may take, and the layout
of one start of its worker group at one of them.

Every start computes the same steps: the global batch, its rows (the data cuts each global
batch by position in the stream, not by dp), the micro-batch's rows and the LR schedule stay;
only how many micro-batches a replica accumulates changes, ``microbatches' = dp * microbatches
/ dp'``. So a dp' is usable when it divides the step's micro-batches over all replicas
(``dp * microbatches`` at parallelism.dp) and the pipeline schedule takes the count it leaves
each replica. The global batch itself never decides: dp * microbatches already divides it.
Expert parallelism keeps its ep and borrows it from every start's dp: a usable dp' is a
multiple of parallelism.ep (a restart reads the experts back from the checkpoint, resharded
like every other weight).
"""

from __future__ import annotations

import dataclasses

from raytrain_hybrid.config.coerce import choices, divisors
from raytrain_hybrid.config.schedule_rules import too_few_microbatches, uneven_microbatches
from raytrain_hybrid.config.schema import Config, ParallelismConfig
from raytrain_hybrid.errors import ConfigError


def is_elastic(par: ParallelismConfig) -> bool:
    return 0 < par.min_dp < par.dp


def _schedule_takes(par: ParallelismConfig, microbatches: int) -> bool:
    """The pipeline schedule runs ``microbatches`` per replica (config.validate's rules)."""
    return not (
        too_few_microbatches(par.schedule, par.pp, microbatches)
        or uneven_microbatches(par.schedule, par.pp, microbatches)
    )


def _usable(par: ParallelismConfig, low: int, total: int) -> list[int]:
    steps = range(low, par.dp + 1)
    return [d for d in steps if total % d == 0 and d % par.ep == 0 and _schedule_takes(par, total // d)]


def _shrinks(par: ParallelismConfig, microbatches: int) -> bool:
    """With ``microbatches`` at parallelism.dp, some dp in [min_dp, dp) is usable.
    (microbatches * min_dp always is one: min_dp then divides the step's micro-batches.)"""
    usable = _usable(par, par.min_dp, par.dp * microbatches)
    return _schedule_takes(par, microbatches) and any(d < par.dp for d in usable)


def usable_dps(par: ParallelismConfig) -> list[int]:
    """The dp values a run may take, ascending: [parallelism.dp] alone for a fixed run."""
    if not is_elastic(par):
        return [par.dp]
    return _usable(par, par.min_dp, par.dp * par.microbatches)


def micro_batch_rows(cfg: Config) -> int:
    par = cfg.parallelism
    return cfg.train.global_batch_size // (par.dp * par.microbatches)


def check_elastic(cfg: Config) -> None:
    """parallelism.min_dp against dp, the batch and the schedule (config.validate calls it)."""
    par = cfg.parallelism
    if not par.min_dp:
        return
    if par.min_dp > par.dp:
        raise ConfigError(
            "parallelism.min_dp",
            par.min_dp,
            f"must be <= parallelism.dp={par.dp} (the most replicas the run takes); use min_dp in "
            f"[1, {par.dp}], or 0 for a fixed dp",
        )
    if not is_elastic(par) or len(usable_dps(par)) > 1:
        return
    total, rows = par.dp * par.microbatches, micro_batch_rows(cfg)
    batch = cfg.train.global_batch_size
    # Expert parallelism borrows ep of every start's replicas: its dp stays a multiple of ep.
    multiples = [d for d in range(par.min_dp, par.dp) if d % par.ep == 0]
    if not multiples:
        fits = [e for e in divisors(par.dp) if any(d % e == 0 for d in range(par.min_dp, par.dp))]
        raise ConfigError(
            "parallelism.min_dp",
            par.min_dp,
            f"every dp a start takes keeps parallelism.ep={par.ep} dividing it (the experts' ranks come from dp), "
            f"and none in [{par.min_dp}, {par.dp - 1}] does; use parallelism.ep in {choices(fits)}, or min_dp=0",
        )
    lower = [d for d in _usable(par, 1, total) if d < par.min_dp]  # 1 is, without experts
    # More micro-batches a replica: the global batch kept if some count divides it, else grown.
    more = [m for m in range(par.microbatches + 1, batch // par.dp + 1) if not batch % (par.dp * m)]
    more = [m for m in more if _shrinks(par, m)]
    if more:
        other = f"parallelism.microbatches={more[0]} (micro-batches of {batch // (par.dp * more[0])} rows)"
    else:  # min_dp (its next multiple of ep) times the micro-batches always lets that dp split them
        m = par.microbatches * multiples[0]
        other = f"parallelism.microbatches={m} with train.global_batch_size={par.dp * m * rows}"
    raise ConfigError(
        "parallelism.min_dp",
        par.min_dp,
        f"no dp in [{par.min_dp}, {par.dp - 1}] splits the step's {total} micro-batches of {rows} rows "
        f"(train.global_batch_size={batch} at dp={par.dp}, microbatches={par.microbatches}) into whole "
        "micro-batches per replica"
        + ("" if par.pp == 1 else f" that {par.schedule} at pp={par.pp} takes")
        + (f" and that parallelism.ep={par.ep} divides" if par.ep > 1 else "")
        + ", so the run could never shrink; use "
        + (f"parallelism.min_dp={lower[-1]}, or " if lower else "")
        + other,
    )


def describe(cfg: Config) -> str:
    """One line for `check`: the dp values and what each start runs."""
    par = cfg.parallelism
    dps = usable_dps(par)
    total, rows = par.dp * par.microbatches, micro_batch_rows(cfg)
    each = ", ".join(f"dp={d}: {total // d}" for d in dps)
    replica = par.cp * par.tp * par.pp  # a replica's workers (context parallelism keeps its cp)
    if par.layout == "auto":  # the planner re-picks each start's layout for the workers it got
        each = ", ".join(f"dp={d}: {d * replica} workers" for d in dps)
        return (
            f"elastic: dp in {choices(dps)} ({replica} workers a replica): {each}; layout auto: every start "
            f"picks the layout of all its workers; global batch {cfg.train.global_batch_size} at every start"
        )
    return (
        f"elastic: dp in {choices(dps)} ({replica} workers a replica); micro-batches a replica, of "
        f"{rows} row{'s' if rows != 1 else ''} each: {each}; global batch {cfg.train.global_batch_size} at every dp"
    )


def at_world(cfg: Config, world: int) -> Config:
    """The config of a start with ``world`` workers: ``cfg`` at its own world size; for an
    elastic run, the layout at dp = world // (cp*tp*pp) with the micro-batches that keep the
    micro-batch's rows. A world that is no usable layout raises ValueError (the launcher asks
    Ray only for usable counts: this is a check)."""
    par = cfg.parallelism
    if world == par.world_size:
        return cfg
    replica = par.cp * par.tp * par.pp
    dp, extra = divmod(world, replica)
    dps = usable_dps(par)
    if extra or dp not in dps:
        raise ValueError(
            f"{world} workers started for a layout of dp={par.dp}{f' cp={par.cp}' if par.cp > 1 else ''} "
            f"tp={par.tp} pp={par.pp}"
            + (
                f"; elastic between dp in {choices(dps)}: a multiple of {'cp*' if par.cp > 1 else ''}tp*pp={replica} "
                "workers"
                if len(dps) > 1
                else ""
            )
        )
    microbatches = par.dp * par.microbatches // dp
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(par, dp=dp, microbatches=microbatches))
