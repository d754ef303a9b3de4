"""Layout sweeps with Ray Tune: the planner's top feasible layouts, one TorchTrainer per trial.

Each trial is a function trainable that runs the launcher (a full TorchTrainer run of a few
steps) and reports measured tokens/s, step time, per-rank memory and loss. A trial that fails
(error, out of memory) is recorded with its reason and the sweep goes on.

Everything a sweep writes goes under its ``out`` directory, a local path, a shared mount or a
URI (s3://, gs://) through raytrain_hybrid.storage: sweep.json, sweep.csv, sweep.png, each
trial's run directory (trials/<name>, a run.output_dir) and Ray Tune's own storage (tune/).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os

from raytrain_hybrid.config import LAYOUT_KEYS, Config
from raytrain_hybrid.planner.hardware import Hardware
from raytrain_hybrid.planner.search import plan
from raytrain_hybrid.storage import Store, as_store

OUT_KEY = "sweep --out"
# What a trial pins: the layout keys, with context and expert parallelism (the planner's cp and ep).
TRIAL_KEYS = tuple(dict.fromkeys((*LAYOUT_KEYS, "cp", "ep")))


def _trial(config: dict) -> None:
    from ray import tune

    from raytrain_hybrid.launch.runtime.driver import run

    cfg = Config.from_dict(config["base"])  # the sweep's resolved config, as a dict
    trial = config["trial"]
    par = dataclasses.replace(cfg.parallelism, **trial["layout"], virtual_stages=0)
    out = as_store(config["out_dir"], OUT_KEY).child(trial["name"]).uri
    run_cfg = dataclasses.replace(cfg.run, output_dir=out, progress=False)
    cfg = dataclasses.replace(cfg, parallelism=par, run=run_cfg)
    try:
        summary = run(cfg)
    except Exception as exc:  # recorded, and the sweep goes on
        tune.report({"failed": True, "reason": f"{type(exc).__name__}: {str(exc)[:500]}"})
        return
    tune.report(
        {
            "failed": False,
            "reason": "",
            "tokens_per_s": summary["mean_tokens_per_s"],
            "step_time_s": summary["mean_step_time_s"],
            "final_loss": summary["final_loss"],
            "param_bytes": summary["param_bytes"],
            "grad_bytes": summary["grad_bytes"],
            "optimizer_bytes": summary["optimizer_bytes"],
            "max_rss_bytes": summary["max_rss_bytes"],
        }
    )


def _name(layout: dict) -> str:
    ac = "-ac" if layout["activation_checkpointing"] else ""
    sp = "-sp" if layout.get("sequence_parallel") and layout["tp"] > 1 else ""
    cp = f"-cp{layout['cp']}" if layout.get("cp", 1) > 1 else ""
    ep = f"-ep{layout['ep']}" if layout.get("ep", 1) > 1 else ""
    shape = f"dp{layout['dp']}{cp}{ep}-tp{layout['tp']}-pp{layout['pp']}"
    return f"{shape}-{layout['schedule']}-m{layout['microbatches']}-z{layout['zero']}{ac}{sp}"


def set_line(layout: dict) -> str:
    return " ".join(
        f"--set parallelism.{k}={str(layout[k]).lower() if isinstance(layout[k], bool) else layout[k]}"
        for k in TRIAL_KEYS
        if k in LAYOUT_KEYS or layout.get(k, 1) != 1  # cp and ep when they split something
    )


def plan_trials(cfg: Config, world: int, hw: Hardware, *, top: int, only: list[dict] | None = None) -> list[dict]:
    """The planner's rows a sweep runs: its ``top`` best feasible layouts, one per distinct shape
    (dp, cp, ep, tp, pp, schedule, ZeRO), context-parallel ones included where the planner has
    them (a model with a cp attention, cp dividing seq_len and the heads); or, for each partial
    layout in ``only``, the best planned row matching it."""
    rows = plan(cfg, world, hw)
    planned, seen = [], set()
    if only is not None:
        for want in only:
            match = next((p for p in rows if all(p[k] == v for k, v in want.items())), None)
            if match is None:
                raise ValueError(f"no valid layout of {world} ranks matches {want}")
            planned.append(match)
        return planned
    for p in rows:  # best first; one trial per distinct layout shape
        key = (p["dp"], p["cp"], p.get("ep", 1), p["tp"], p["pp"], p["schedule"], p["zero"])
        if p["feasible"] and key not in seen and len(planned) < top:
            seen.add(key)
            planned.append(p)
    return planned


def sweep(
    cfg: Config,
    world: int,
    hw: Hardware,
    *,
    top: int,
    steps: int,
    out_dir: str | os.PathLike | Store,
    only: list[dict] | None = None,
) -> list[dict]:
    """Run the planner's ``top`` best distinct feasible layouts (or the planned rows matching
    each partial layout in ``only``, e.g. ``{"dp": 2, "tp": 2, "pp": 1}``) as Tune trials.
    ``out_dir``: a directory or URI for the results (see the module docstring)."""
    from raytrain_hybrid.launch.runtime.session import ensure_ray, use_train_v2

    use_train_v2()  # before ray.tune imports ray.train
    from ray import tune

    out = as_store(out_dir, OUT_KEY)
    out.makedirs()
    planned = plan_trials(cfg, world, hw, top=top, only=only)
    base = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    ensure_ray(cfg, world)
    trials = [{"name": _name(p), "layout": {k: p[k] for k in TRIAL_KEYS}} for p in planned]
    tuner = tune.Tuner(
        tune.with_resources(_trial, {"CPU": 0.01}),  # the trial waits; its TorchTrainer holds the CPUs
        param_space={
            "base": base.to_dict(),
            "out_dir": out.child("trials").uri,
            "trial": tune.grid_search(trials),
        },
        tune_config=tune.TuneConfig(max_concurrent_trials=1),  # each trial takes every worker slot
        run_config=tune.RunConfig(
            # A path on the store's filesystem (no scheme: Tune refuses a URI with a filesystem).
            storage_path=out.child("tune").path,
            storage_filesystem=out.fs,
            name="sweep",
            verbose=0,
            callbacks=[_progress(len(trials))],
        ),
    )
    grid = tuner.fit()
    by_name = {}
    for result in grid:
        metrics = result.metrics or {}
        name = (result.config or {}).get("trial", {}).get("name")
        failed = metrics.get("failed", True) or result.error is not None
        reason = metrics.get("reason") or (str(result.error)[:500] if result.error else "")
        by_name[name] = {**metrics, "failed": bool(failed), "reason": reason}
    rows = []
    for p, t in zip(planned, trials, strict=True):
        m = by_name.get(t["name"], {"failed": True, "reason": "no result"})
        rows.append(
            {
                "name": t["name"],
                **t["layout"],
                "failed": m["failed"],
                "reason": m.get("reason", ""),
                "measured_tokens_per_s": m.get("tokens_per_s"),
                "measured_step_s": m.get("step_time_s"),
                "final_loss": m.get("final_loss"),
                "param_bytes": m.get("param_bytes"),
                "grad_bytes": m.get("grad_bytes"),
                "optimizer_bytes": m.get("optimizer_bytes"),
                "max_rss_bytes": m.get("max_rss_bytes"),
                "predicted_tokens_per_s": p["predicted_tokens_per_s"],
                "predicted_step_s": p["predicted_step_s"],
                "predicted_state_bytes": p["memory_bytes"]["params"]
                + p["memory_bytes"]["grads"]
                + p["memory_bytes"]["optimizer"],
            }
        )
    _save(rows, out)
    return rows


def _save(rows: list[dict], out: Store) -> None:
    out.child("sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    out.child("sweep.csv").write_text(table.getvalue())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from raytrain_hybrid.tools.plots import plot_sweep

    fig = plot_sweep(rows)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    out.child("sweep.png").write_bytes(png.getvalue())


def _progress(total: int):
    """A Tune callback that shows the sweep on the driver: a bar on a terminal, lines otherwise."""
    import sys

    from ray.tune import Callback

    class SweepProgress(Callback):
        def __init__(self) -> None:
            self.done = 0
            self.bar = None
            if sys.stdout.isatty():
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

                self.bar = Progress(
                    TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}")
                )
                self.task = self.bar.add_task("running the first trial", total=total)
                self.bar.start()

        def _finished(self, trial, what: str) -> None:
            self.done += 1
            name = trial.config.get("trial", {}).get("name", trial.trial_id)
            if self.bar is not None:
                self.bar.update(self.task, completed=self.done, description=f"{name}: {what}")
                if self.done == total:
                    self.bar.stop()
            else:
                print(f"sweep {self.done}/{total}  {name}: {what}", flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info) -> None:
            m = trial.last_result or {}
            tps = m.get("tokens_per_s")
            self._finished(trial, "failed" if m.get("failed", True) else f"{tps:,.0f} tokens/s" if tps else "done")

        def on_trial_error(self, iteration, trials, trial, **info) -> None:
            self._finished(trial, "error")

    return SweepProgress()


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def rank_correlation(rows: list[dict]) -> float:
    """Spearman's rank correlation of predicted and measured tokens/s over successful trials."""
    rx = _ranks([r["predicted_tokens_per_s"] for r in rows])
    ry = _ranks([r["measured_tokens_per_s"] for r in rows])
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy)
