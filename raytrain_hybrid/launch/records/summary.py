"""summary.json: the run's outcome, throughput, memory per rank and start-up breakdown."""

from __future__ import annotations

from raytrain_hybrid.config import Config, layout_dict

# summary.json's "layout". virtual_stages is 1 at pp=1: validation allows pp=1 only with a
# single-stage schedule.
SUMMARY_LAYOUT = ("dp", "tp", "pp", "microbatches", "schedule", "zero", "virtual_stages", "activation_checkpointing")

# Start-up phases, each from the mark before it: where the time to the first step goes.
_PHASES = (
    ("plan", "planned"),  # the checks and the run plan, before Ray starts (launch.runtime.start.plan_run)
    ("ray_init", "ray_ready"),
    ("input_check", "input_checked"),
    ("worker_start", "worker_entered"),  # placement group, worker processes, process group
    ("worker_imports", "worker_imported"),
    ("process_group", "group_ready"),
    ("mesh", "mesh_built"),
    ("model_build", "model_built"),
    ("checkpoint_load", "checkpoint_loaded"),
    ("first_batch", "first_batch"),
    ("first_step", "first_step_done"),
)


def startup_breakdown(marks: dict) -> dict:
    """Seconds per start-up phase (rank 0's worker marks, the driver's own), and the total
    from the command to the end of the first step."""
    out, last = {}, marks.get("launched")
    for name, mark in _PHASES:
        if mark in marks and last is not None:
            out[name] = round(marks[mark] - last, 3)
            last = marks[mark]
    if "first_step_compile_s" in marks:  # a duration: the part of first_step torch.compile took
        out["first_step_compile"] = round(marks["first_step_compile_s"], 3)
    if "first_step_done" in marks:
        out["total_to_first_step"] = round(marks["first_step_done"] - marks["launched"], 3)
    return out


def startup_cpu(marks: dict) -> dict:
    """CPU seconds of rank 0's worker process: before the train function ran (``ray_worker``:
    the process, Ray's and torch's imports, the process group: what any Ray Train worker
    spends), then per phase of :func:`startup_breakdown` from the imports on, and in all to
    the end of the first step. Beside the wall clock: with fewer cores than workers the start
    is CPU-bound, and these are what each worker adds."""
    if "cpu_worker_entered" not in marks:
        return {}
    out, last = {"ray_worker": round(marks["cpu_worker_entered"], 3)}, marks["cpu_worker_entered"]
    for name, mark in _PHASES[_PHASES.index(("worker_start", "worker_entered")) + 1 :]:
        if "cpu_" + mark in marks:
            out[name] = round(marks["cpu_" + mark] - last, 3)
            last = marks["cpu_" + mark]
    if "cpu_first_step_done" in marks:
        out["total_to_first_step"] = round(marks["cpu_first_step_done"], 3)
    return out


def summarize(
    cfg: Config, history: list[dict], memory: list[dict], restarts: int = 0, restarted_from: list[int] | None = None
) -> dict:
    par = cfg.parallelism
    # The first steps pay for warm-up (allocations, pipeline shape inference); leave them out.
    steady = history[min(2, len(history) - 1) :] if history else []
    summary = {
        "final_loss": history[-1]["loss"] if history else None,
        "steps": len(history),
        "restarts": restarts,
        "restarted_from": restarted_from or [],  # per restart, the checkpoint's step it continued from
        "world_size": par.world_size,
        "layout": layout_dict(par, SUMMARY_LAYOUT)
        | ({"cp": par.cp} if par.cp > 1 else {})
        | ({"ep": par.ep} if par.ep > 1 else {})
        | ({"replicate": par.replicate} if par.replicate > 1 else {}),
        "model": {"arch": cfg.model.arch, "num_layers": cfg.model.num_layers, "hidden_size": cfg.model.hidden_size},
        "mean_tokens_per_s": (sum(h["tokens_per_s"] for h in steady) / len(steady)) if steady else None,
        "mean_step_time_s": (sum(h["step_time_s"] for h in steady) / len(steady)) if steady else None,
        "mean_tflops_per_device": (sum(h["tflops_per_device"] for h in steady) / len(steady)) if steady else None,
        "mean_mfu": (sum(h["mfu"] for h in steady) / len(steady)) if steady and steady[0]["mfu"] else None,
    }
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "max_rss_bytes", "data_wait_fraction"):
        summary[key] = max((m[key] for m in memory if m.get(key) is not None), default=None)
    summary["per_rank"] = memory
    if (
        history
        and not cfg.fault_tolerance.enabled
        and (  # (a replica group misses steps by design)
            unrecorded := sorted(set(range(history[0]["step"], history[-1]["step"])) - {h["step"] for h in history})
        )
    ):
        # Steps trained (the model holds them) whose metrics no one kept: a killed driver's
        # workers went on past what it heard, and no checkpoint recorded them (the resume said so).
        summary["steps_unrecorded"] = unrecorded
    if cfg.fault_tolerance.enabled:
        summary["fault_tolerance"] = replica_record(cfg, history)
    evals = [{k: h[k] for k in h if k == "step" or k.startswith("val_")} for h in history if "val_accuracy" in h]
    if evals:  # classifiers: every evaluation, and the last one on its own
        summary["evals"] = evals
        summary["final_eval"] = evals[-1]
    return summary


def replica_record(cfg: Config, history: list[dict]) -> dict:
    """[fault_tolerance]: this launch's replica group, and per group the steps it missed (the
    steps this group trained whose ``replicas_in_step`` lacks it; metrics.jsonl has every step's)."""
    from raytrain_hybrid.config.fault_tolerance import replica_groups

    groups = replica_groups(cfg.parallelism)
    missed = {str(g): [h["step"] for h in history if g not in h.get("replicas_in_step", [g])] for g in range(groups)}
    return {
        "replica_group": cfg.fault_tolerance.replica_group,
        "replica_groups": groups,
        "steps_trained_here": len(history),
        "steps_without": {g: steps for g, steps in missed.items() if steps},
    }


def done_line(summary: dict, output_dir: str) -> str:
    """The last line of a run that ended well: its steps, final loss, throughput and newest
    checkpoint (a run that trained no step says so rather than formatting a loss it has not)."""
    newest = f"; newest checkpoint {summary['checkpoints'][-1]['path']}" if summary["checkpoints"] else ""
    if not summary["steps"]:
        return f"done: 0 steps trained -> {output_dir}{newest}"
    return (
        f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['mean_tokens_per_s']:,.0f} tokens/s -> {output_dir}{newest}"
    )
