"""A run's start, worked out once on the driver: where it starts and writes, the cluster it may
reach, its layout, the workers' count and resources, where they are placed, the steps it trains.

Every check and the launch read this one plan (launch.plan.run_plan.RunPlan) instead of each working the
same facts out again. It is derived before Ray starts (plan_run; a private local Ray is planned as
the node it will be, a named cluster is read), the driver says it, and only then is Ray started for
it (start_run): a refused run has not started Ray, and `check` derives the same plan the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from raytrain_hybrid.checkpoint.manifest import (
    MANIFEST,
    check_compatible,
    done_already,
    manifest_problem,
    resolve,
    step_dirs,
    step_number,
    verify,
)
from raytrain_hybrid.checkpoint.shapes import check_shapes
from raytrain_hybrid.checkpoint.trajectory import check_allowed, check_trajectory, data_restarts, describe
from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.plan import reach as reach_of  # called through it: tests stub the reach
from raytrain_hybrid.launch.plan.address import ray_address
from raytrain_hybrid.launch.plan.autolayout import choose_layout, held_nodes, use_gpu_for
from raytrain_hybrid.launch.plan.elastic import start_line, worker_counts
from raytrain_hybrid.launch.plan.inputs import check_input, finish_input, reader_env, steps_to_train
from raytrain_hybrid.launch.plan.placement import worker_resources
from raytrain_hybrid.launch.plan.preflight import check_placement, check_weights, crowded, predict_start
from raytrain_hybrid.launch.plan.reach import Reach
from raytrain_hybrid.launch.plan.run_plan import DataSource, ResumePoint, RunPlan
from raytrain_hybrid.launch.runtime.session import join_ray, local_cpus, resolve_use_gpu
from raytrain_hybrid.models.custom import registered
from raytrain_hybrid.planner.hardware import Hardware
from raytrain_hybrid.storage import Store, open_store


def check_resume(
    cfg: Config,
    resume: str | None,
    allow_change: list[str] | None = None,
    say=print,
    *,
    out: Store | None = None,
    dry: bool = False,
) -> ResumePoint:
    """Before anything starts: the checkpoint to resume is intact, fits this config and continues
    its trajectory (or the change is allowed: ``allow_change``), and no earlier run's checkpoints
    in run.output_dir would be overwritten. The history kept is the resumed run's, when it
    continues in place. ``out``: run.output_dir as opened to read it (default: opened here);
    ``dry`` (``check``): nothing is written or deleted, and a run from scratch gets no trajectory."""
    out = out or open_store(cfg.run.output_dir)
    ckpt_root = out.child("checkpoints")
    existing = step_dirs(ckpt_root)
    if resume is None:
        # A step directory without a manifest is a save cut short before anything was complete (on
        # object storage, which has no rename): no checkpoint, and this run's save of that step replaces it.
        if existing := [p for p in existing if p.child(MANIFEST).exists()]:
            raise ConfigError(
                "run.output_dir",
                out.uri,
                f"holds checkpoints of an earlier run ({existing[-1].name}); continue it with "
                f"--resume {out.uri}, or choose another run.output_dir",
            )
        if dry:
            return ResumePoint(None, [], {})
        ckpt_root.child("checkpoint_manager_snapshot.json").delete()  # Ray's, of a run with none
        return ResumePoint(None, [], describe(cfg))
    allowed = check_allowed(allow_change or [])
    path, manifest = resolve(resume)
    if manifest["verified"] != "sha256":
        size = sum(f["size"] for f in manifest["files"].values()) / 2**30
        say(f"resume: {path} holds {size:,.0f} GiB: its files' sizes and metadata are checked, not their SHA-256")
    in_place = path.parent.uri == ckpt_root.uri
    # Its last step's checkpoint complete and the run's records maybe not (a driver killed as its
    # workers finished): nothing to train; the resume completes metrics.jsonl and summary.json.
    finishing = in_place and not cfg.fault_tolerance.enabled and manifest["step"] == cfg.train.steps
    check_compatible(cfg, manifest, path, done_ok=finishing)
    # The shards hold the model this config builds (the manifest's, as check_compatible holds), and its
    # optimizer state: refused here, not as a traceback in every worker once Ray has started.
    check_shapes(path, cfg, "--resume", optimizer=not finishing)
    unverified: list[str] = []
    unrecorded: list[str] = []
    changed = check_trajectory(cfg, manifest, path, allowed, unverified, unrecorded)
    for key in unverified:  # (data.path on a bucket this node cannot list, a tokenizer unreadable here)
        say(f"resume: {key} not verified: what the checkpoint recorded of it cannot be read here")
    for key in unrecorded:  # (the run that saved it could not read its data or tokenizer)
        say(f"resume: {key} not verified: it could not be read when {path.name} was saved, so nothing was recorded")
    if finishing and "train.steps" in changed:
        raise done_already(cfg.train.steps, manifest, path)
    origin = manifest.get("data_origin", 0)
    for key in changed:
        say(f"resume: {key} differs from the checkpoint's (allowed by --allow-change)")
    if data_restarts(changed):
        origin = manifest["step"]
        say(f"resume: the data starts from its beginning at step {origin + 1}")
    # Only complete ones: on object storage a save cut short (a lost node, a killed job) leaves
    # step_<N>/ without its manifest, which the next save of step N replaces.
    if existing and not in_place:
        raise ConfigError(
            "run.output_dir",
            out.uri,
            f"holds checkpoints of another run ({existing[-1].name}); resuming {path} there would mix and prune "
            "them: resume into an empty run.output_dir (--set run.output_dir=...), or continue that run with "
            f"--resume {out.uri}",
        )
    later = [p for p in existing if step_number(p) > manifest["step"] and _intact(p)]
    if later:
        raise ConfigError(
            "run.output_dir",
            out.uri,
            f"resuming {path.name} here would overwrite the later {later[-1].name}; "
            "resume into another run.output_dir (--set run.output_dir=...)",
        )
    for p in existing:  # a later one written whole but damaged since: said, never replaced unsaid
        if step_number(p) > manifest["step"] and p.child(MANIFEST).exists():
            say(f"resume: {p.name} is later than {path.name} but not intact; this run's save of its step replaces it")
    history = []
    metrics = out.child("metrics.jsonl")
    if in_place:  # continuing in place: keep the steps before
        if metrics.exists():
            history = [h for h in _metrics_lines(metrics, say) if h["step"] < manifest["step"]]
        others, heard, told = [p for p in existing if p.uri != path.uri], {h["step"] for h in history}, []
        gaps = not cfg.fault_tolerance.enabled
        history = _with_checkpoint_records(history, manifest, others, told.append if finishing else say, gaps)
        if finishing:
            _say_finished(out, path, manifest, history, heard, told, say, dry)
    return ResumePoint(path.uri, history, describe(cfg), origin, manifest["step"], finished=finishing)


def _say_finished(out: Store, path: Store, manifest: dict, history, heard: set, told: list[str], say, dry) -> None:
    """A resume of a run whose last checkpoint is complete: what of its records it completes,
    said in one line; a run whose metrics.jsonl and summary.json are whole is refused, as done."""
    added = [h["step"] for h in history if h["step"] not in heard]
    try:
        summary = json.loads(out.child("summary.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        summary = None
    ended = isinstance(summary, dict) and summary.get("ended") == "completed" and summary.get("steps") == len(history)
    if not added and ended:
        raise done_already(manifest["step"], manifest, path)
    lacked = [f"metrics.jsonl lacked {_spans(added)}"] if added else []
    lacked += [] if ended else ["summary.json its end"]
    gaps = "".join(f"; {line.removeprefix('resume: ')}" for line in told if line.startswith("resume: no record"))
    say(
        f"resume: nothing left to train: the checkpoint {path} has done all {manifest['step']} steps; "
        f"{' and '.join(lacked)}: {'train --resume writes' if dry else 'written'} from the checkpoints' records{gaps}"
    )


def _with_checkpoint_records(history: list[dict], manifest: dict, others: list[Store], say, gaps=True) -> list[dict]:
    """The steps before the resumed checkpoint that metrics.jsonl lacks, from the records each
    checkpoint keeps of the steps since the save before it: a driver killed while its workers went
    on never heard of their last steps (nor of a save they completed, which a resume then picks).
    Steps no checkpoint here recorded either are said (``gaps``; a replica group of a fault-tolerant
    run misses steps by design), and summary.json lists them."""
    end, have = manifest["step"], {h["step"] for h in history}
    found: dict[int, dict] = {}
    last = max(have, default=-1)
    for other in others:  # the earlier checkpoints in the run directory, each with its window of steps
        if (step := step_number(other)) is None or step > end or step <= last + 1:
            continue  # (one whose steps metrics.jsonl has is not read)
        try:
            theirs = json.loads(other.child(MANIFEST).read_bytes())
        except (OSError, ValueError, RecursionError):
            continue
        if manifest_problem(theirs) is None:
            found.update({r["step"]: r for r in theirs.get("steps", [])})
    found.update({r["step"]: r for r in manifest.get("steps", [])})  # (the one resumed is verified)
    added = sorted(s for s in found if s not in have)
    if added:
        say(
            f"resume: metrics.jsonl lacked {_spans(added)} (trained after its driver stopped hearing, "
            "a driver killed?); their metrics are taken from the checkpoints' records"
        )
    history = sorted([*history, *(found[s] for s in added)], key=lambda h: h["step"])
    if gaps and history and (missing := sorted(set(range(history[0]["step"], end)) - {h["step"] for h in history})):
        say(f"resume: no record of {_spans(missing)} was kept (not in metrics.jsonl nor in a checkpoint here)")
    return history


def _spans(steps: list[int]) -> str:
    """0-based steps as the 1-based steps a user reads (metrics.jsonl's 0 is step 1): "steps 2-4,
    7", "step 3"."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    said = ", ".join(f"{a + 1}-{b + 1}" if b > a else f"{a + 1}" for a, b in spans)
    return f"step {said}" if len(steps) == 1 else f"steps {said}"


def _metrics_lines(metrics: Store, say) -> list[dict]:
    """The steps metrics.jsonl records. A last line cut off (the run was killed while writing it)
    is left out, and said; any other line that is not a step's record is refused, naming it."""
    lines = metrics.read_bytes().decode(errors="replace").splitlines()  # (a cut may split a character)
    steps = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            steps.append(record)
        elif number == len(lines):
            say(f"resume: the last line of {metrics.uri} was cut off (a run killed while writing it); left out")
        else:
            raise ConfigError(
                "run.output_dir",
                metrics.uri,
                f"line {number} is not a step's record (JSON with an integer step): {line[:80]!r}; "
                "move the file aside to resume without the earlier steps' metrics",
            )
    return steps


def _intact(path) -> bool:
    """A complete checkpoint by its sizes and metadata (a broken one is not "later" than a resume)."""
    try:
        verify(path, digests=False)
    except ConfigError:
        return False
    return True


def prepare_run_dir(
    cfg: Config, resume: str | None, allow_change: list[str] | None = None, say=print, *, reader=None
) -> tuple[Config, ResumePoint]:
    """run.output_dir as workers on any node reach it (a local path made absolute, a URI as
    it is), and the resume checked (see check_resume). ``reader`` (``check``): opens the store
    to read it; given, nothing is written or deleted."""
    out = open_store(cfg.run.output_dir)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=out.uri))
    if reader is None:
        return cfg, check_resume(cfg, resume, allow_change, say)
    return cfg, check_resume(cfg, resume, allow_change, say, out=reader(out), dry=True)


def run_nodes(cfg: Config, topology: list[int] | None = None) -> Reach:
    """The nodes a run's plan is for, known before Ray starts: ``topology``'s (`check --topology`),
    the named cluster's or the one this process has joined (read: a cluster that is up is a fact
    the plan needs), or the one node of the private local Ray that `train` starts here once the
    plan is made (start_run: its CPUs local_cpus, this machine's GPUs)."""
    if topology:
        return Reach(held_nodes(cfg, topology))
    ray = sys.modules.get("ray")  # (not imported for a local run: Ray's import alone is seconds)
    if ray_address(cfg) or ray is not None and ray.is_initialized():  # (a sweep's trial has joined one)
        join_ray(ray_address(cfg))
        return reach_of.cluster_reach(bool(ray_address(cfg)), cfg.cluster.accelerator_type)
    gpus = local_gpus()
    node = {"CPU": float(local_cpus(cfg, cfg.parallelism.world_size)), **({"GPU": float(gpus)} if gpus else {})}
    return Reach([node])


def local_gpus() -> int:
    """This machine's NVIDIA GPUs as Ray counts them (CUDA_VISIBLE_DEVICES, else the driver's list),
    without importing torch or Ray."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def check_before_ray(cfg: Config, say=print) -> tuple[Config, DataSource]:
    """The checks `train` makes before Ray starts, and `check` makes the same: the pretrained
    checkpoint's weights, a machine given far more workers than cores (said), the input
    (launch.plan.inputs.check_input). Returns the config with data.path resolved and the input as
    checked (what is left needs Ray: launch.plan.inputs.finish_input)."""
    check_weights(cfg)
    if warning := crowded(cfg):
        say(warning)
    return check_input(cfg, say)


def plan_run(
    cfg: Config,
    point: ResumePoint,
    say=print,
    *,
    data: DataSource,
    asked: Config | None = None,
) -> RunPlan:
    """`train`'s plan, derived before Ray starts (ConfigError/LayoutError if there is none): the
    nodes it is for (run_nodes), layout=auto's pick for them, and derive_plan, the derivation
    `check` shares. ``data``: ``cfg``'s input as checked (check_before_ray); what its check left
    is done once Ray is up (start_run). ``asked``: the config as loaded."""
    reach = run_nodes(cfg)
    cfg, layout_hw = choose_layout(cfg, say, reach, use_gpu_for(cfg, reach.nodes))
    return derive_plan(cfg, point, reach, layout_hw, say, data=data, asked=asked)


def start_run(plan: RunPlan, marks: dict, say=print) -> None:
    """Ray for ``plan``: the cluster it names joined, else the private local Ray of the node it was
    planned for started; then the output directory made (only now: a refused run leaves nothing
    behind) and what the input's check left for Ray done (launch.plan.inputs.finish_input: the shipped
    corpus prepared into the plan's data.path the first time, chat rows too many to encode here)."""
    cfg = plan.cfg
    join_ray(ray_address(cfg), need_cpus=0 if ray_address(cfg) else int(sum(n["CPU"] for n in plan.reach.live)))
    marks["ray_ready"] = time.time()
    open_store(cfg.run.output_dir).makedirs()
    finish_input(cfg, plan.data, say)
    marks["input_checked"] = time.time()


def derive_plan(
    cfg: Config,
    point: ResumePoint,
    reach: Reach,
    layout_hw: Hardware | None,
    say=print,
    *,
    data: DataSource | None,
    placement: list[int] | None = None,
    checked: bool = True,
    lease: str = RunPlan.lease,
    unverified: list[str] | None = None,
    asked: Config | None = None,
) -> RunPlan:
    """The plan of ``cfg`` (at its layout) on the nodes of ``reach``, the one derivation `train`
    and `check` share, made before Ray starts and writing nothing: the worker counts, whether they
    use GPUs, what each asks of Ray, where they are placed and the steps trained. ``data``: the
    input as checked (check_before_ray; None: `check` could not read it here). ``placement``:
    None, predicted for the live nodes and, ``checked``, checked against them (check_placement);
    else the workers per node given (`check --topology`). ``unverified`` (`check`): rows that
    cannot be counted here are noted there, not refused. ``asked``: the config as loaded (default
    ``cfg``)."""
    counts = worker_counts(cfg)
    use_gpu = resolve_use_gpu(cfg, counts[0], reach.nodes)  # an elastic run starts on fewer
    resources = worker_resources(cfg, use_gpu)
    if placement is None and checked:
        placement = check_placement(cfg, resources, reach.live, counts)
    elif placement is None:  # `check`: the prediction alone (the weights and the output directory are not read)
        placement = predict_start(cfg, resources, reach.live, counts)[1]
    try:
        end = steps_to_train(cfg)
    except (OSError, ValueError) as exc:  # pyarrow's errors: a bucket out of reach, files not Parquet
        if unverified is None:
            raise
        unverified.append(f"data.path={cfg.data.path!r}: its rows were not counted here ({exc})")
        end = cfg.train.steps
    data_env = {}  # `check` lists no bucket again (its check of the input has read what it could)
    if data is not None:
        data_env = reader_env(cfg, data.files)
    if end < cfg.train.steps:
        say(
            f"data.epochs={cfg.data.epochs}: the rows hold {end} global batches of {cfg.train.global_batch_size}; "
            f"the run ends after step {end} (the LR schedule is train.steps={cfg.train.steps}'s)"
        )
    if is_elastic(cfg.parallelism):
        say(start_line(cfg))
    return RunPlan(
        cfg,
        point,
        reach,
        use_gpu,
        resources,
        counts,
        placement,
        layout_hw,
        end,
        lease,
        asked=asked,
        data_env=data_env,
        registered_models=tuple(registered()),
        unverified=tuple(unverified or ()),
        data=data,
    )
