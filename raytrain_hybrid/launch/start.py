"""A run's start, worked out once on the driver: where it starts and writes, the cluster it may
reach, its layout, the workers' count and resources, where they are placed, the steps it trains.

Every check and the launch read this one plan (``RunPlan``) instead of each working the same
facts out again; the driver says it before the workers start (``RunPlan.lines``), and the
checks that need no cluster (the resume, the trajectory, the output directory) come first, so a
refused run has not started Ray.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from raytrain_hybrid.checkpoint.manifest import MANIFEST, check_compatible, resolve, step_dirs, step_number, verify
from raytrain_hybrid.checkpoint.trajectory import check_allowed, check_trajectory, data_restarts, describe
from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic
from raytrain_hybrid.engine.plan import WorkerPlan
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.launch.autolayout import choose_layout, use_gpu_for
from raytrain_hybrid.launch.elastic import start_line, worker_counts
from raytrain_hybrid.launch.inputs import check_input, finish_input, prepare_input, reader_env, steps_to_train
from raytrain_hybrid.launch.placement import worker_resources
from raytrain_hybrid.launch.preflight import check_placement, check_weights, crowded, predict_start
from raytrain_hybrid.launch.reach import Reach, cluster_reach
from raytrain_hybrid.launch.session import ensure_ray, ray_address, resolve_use_gpu
from raytrain_hybrid.models.custom import registered
from raytrain_hybrid.planner.hardware import Hardware
from raytrain_hybrid.storage import Store, is_uri, open_store


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint (None: from scratch), the metrics history to keep,
    the run's trajectory record (checkpoint.trajectory) and the step its data began at."""

    path: str | None
    history: list[dict]
    trajectory: dict
    data_origin: int = 0
    step: int = 0  # the checkpoint's steps done


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
    check_compatible(cfg, manifest, path)
    unverified: list[str] = []
    changed = check_trajectory(cfg, manifest, path, allowed, unverified)
    for key in unverified:  # (data.path on a bucket this node cannot list, a tokenizer unreadable here)
        say(f"resume: {key} not verified: what the checkpoint recorded of it cannot be read here")
    origin = manifest.get("data_origin", 0)
    for key in changed:
        say(f"resume: {key} differs from the checkpoint's (allowed by --allow-change)")
    if data_restarts(changed):
        origin = manifest["step"]
        say(f"resume: the data starts from its beginning at step {origin + 1}")
    # Only complete ones: on object storage a save cut short (a lost node, a killed job) leaves
    # step_<N>/ without its manifest, which the next save of step N replaces.
    if existing and path.parent.uri != ckpt_root.uri:
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
    if path.parent.uri == ckpt_root.uri and metrics.exists():  # continuing in place: keep the steps before
        history = [h for h in _metrics_lines(metrics, say) if h["step"] < manifest["step"]]
    return ResumePoint(path.uri, history, describe(cfg), origin, manifest["step"])


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


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run, derived once on the driver from the config as loaded (``asked``, never replaced), the
    cluster's reach and the resume point: `check` prints it, `train` runs it, and its workers get
    the part they need read-only (``for_workers``)."""

    cfg: Config  # the run's: at the layout it starts with; run.output_dir absolute or a URI; data.path resolved
    point: ResumePoint  # the checkpoint it starts from, the history kept, the trajectory, the data's origin
    reach: Reach | None  # the live nodes and those an autoscaler may add (None: torchrun's nodes, not Ray's)
    use_gpu: bool
    resources: dict[str, float]  # what each worker asks of Ray
    counts: list[int]  # the worker counts a start may have, ascending (one for a fixed run)
    placement: list[int] | None  # predicted workers per node at the first start (None: nodes still to come)
    layout_hw: Hardware | None  # the profile layout=auto priced on (an elastic run's workers pick on it)
    end: int  # the steps it trains (data.epochs may end it before train.steps)
    lease: str = "held by this run"  # run.output_dir's lease when planned (`check` reads it, never takes it)
    asked: Config | None = None  # the config as loaded, before the plan resolved anything (None: ``cfg``)
    data_env: dict[str, str] = dataclasses.field(default_factory=dict)  # Ray Data's readers' (launch.inputs)
    registered_models: tuple = ()  # models registered from Python (models.custom): each worker registers them again
    unverified: tuple[str, ...] = ()  # what `check` could not read here (no network, no credentials)
    # Written into every manifest of this launch: a restart tells its own checkpoints apart.
    launch_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    def for_workers(self) -> WorkerPlan:
        """What every worker is given, read-only (Ray Train's train_loop_config, torchrun's broadcast)."""
        elastic_auto = self.layout_hw is not None and is_elastic(self.cfg.parallelism)
        return WorkerPlan(
            cfg=self.cfg,
            use_gpu=self.use_gpu,
            resume=self.point.path,
            launch_id=self.launch_id,
            end=self.end,
            trajectory=self.point.trajectory,
            data_origin=self.point.data_origin,
            data_env=dict(self.data_env),
            # An elastic run with layout=auto: the profile each start's pick is priced on.
            layout_hardware=dataclasses.asdict(self.layout_hw) if elastic_auto else None,
            registered_models=tuple(self.registered_models),
        )

    def resolved(self) -> dict[str, list]:
        """The config's keys the plan resolved: {key: [as asked, as planned]} (the output
        directory made absolute, data.path resolved, a layout picked)."""
        asked = _flat(self.asked.to_dict()) if self.asked is not None else {}
        planned = _flat(self.cfg.to_dict())
        return {k: [asked[k], v] for k, v in planned.items() if k in asked and asked[k] != v}

    def to_json(self) -> dict:
        """The whole plan as data (`check --json`'s "plan"): its facts, what it resolved of the
        config, what it could not verify, and what every worker is given."""
        worker = dataclasses.asdict(self.for_workers())
        del worker["launch_id"]  # new at each plan: not a fact of the run
        return {
            **self.facts(),
            "resolved": self.resolved(),
            "unverified": list(self.unverified),
            "history_kept": len(self.point.history),
            "worker_plan": worker,
        }

    def facts(self) -> dict:
        """The plan's start as data (`check --json`'s "start"); ``lines`` says the same."""
        par = self.cfg.parallelism
        added = self.reach.added if self.reach else {}
        return {
            **{axis: getattr(par, axis) for axis in ("dp", "cp", "tp", "pp", "ep")},
            "workers": list(self.counts),
            "resources": dict(self.resources),
            "use_gpu": self.use_gpu,
            "placement": self.placement,
            "live_nodes": len(self.reach.live) if self.reach else None,
            "autoscaler_may_add": {name: n for name, (n, _) in added.items()},
            "steps": self.end,
            "output": output_uri(self.cfg),
            "output_store": output_where(self.cfg),
            "lease": self.lease,
            "resume": self.point.path,
            "resume_step": self.point.step,
        }

    def lines(self) -> list[str]:
        """The plan as the driver says it before the workers start, and as `check` prints it."""
        f, par = self.facts(), self.cfg.parallelism
        counts = f"{self.counts[0]} to {self.counts[-1]}" if len(self.counts) > 1 else f"{self.counts[0]}"
        each = ", ".join(f"{v:g} {k}" for k, v in self.resources.items())
        placed = f" on nodes holding {self.placement}" if self.placement else " on nodes still to come"
        start = f"resumed from {self.point.path} at step {self.point.step}" if self.point.path else "from step 0"
        cp = f" cp={par.cp}" if par.cp > 1 else ""
        if cp and self.placement:  # where the cp groups' all-to-alls run: inside a node or across
            from raytrain_hybrid.distributed.parallel_dims import ParallelDims, placement_report

            placed += f" ({placement_report(ParallelDims.from_config(par), self.placement)['cp_placement']})"
        cp += f" ep={par.ep}" if par.ep > 1 else ""  # as check's layout line names it
        if par.replicate > 1:  # hybrid sharding: where its shard and replica groups sit on these nodes
            from raytrain_hybrid.distributed.parallel_dims import ParallelDims, placement_report

            cp += f" zero={par.zero} replicate={par.replicate}"
            if self.placement:
                placed += f" ({placement_report(ParallelDims.from_config(par), self.placement)['hsdp_where']})"
        return [
            f"start: dp={par.dp}{cp} tp={par.tp} pp={par.pp}, {counts} workers ({each} each){placed}; "
            f"{self.end} steps; output {f['output']} ({f['output_store']}); {start}"
        ]

    def detail_lines(self) -> list[str]:
        """What `check` prints of the plan beyond the start line: the data and model the workers
        get, the keys the plan resolved, and the resume's data origin."""
        d, m = self.cfg.data, self.cfg.model
        data = f"plan: data {d.path}" + (f", validation {d.val_path}" if d.val_path else "")
        data += f"; model {m.arch}" + (f" from {m.pretrained}" if m.pretrained else " (initialised)")
        lines = [data]
        if self.point.path and self.point.data_origin:
            lines.append(f"plan: the data began at step {self.point.data_origin + 1}")
        for key, (asked, planned) in self.resolved().items():
            lines.append(f"plan: {key}={asked!r} -> {planned!r}")
        return lines


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out


def output_uri(cfg: Config) -> str:
    """run.output_dir as the start line says it: a URI as given, without opening it (`check` says
    the plan of a bucket it cannot reach), a local path made absolute."""
    loc = cfg.run.output_dir
    return loc.rstrip("/") if is_uri(loc) and not loc.startswith("file://") else open_store(loc).uri


def output_where(cfg: Config) -> str:
    """Where run.output_dir's bytes live, as the start line says it."""
    loc = cfg.run.output_dir
    if is_uri(loc) and not loc.startswith("file://"):
        return "object storage"
    return "a shared mount" if cfg.run.shared_fs else "this node's disk"


def open_session(cfg: Config, marks: dict, say=print) -> tuple[Config, Reach, Hardware | None]:
    """Join or start Ray and pick the layout (parallelism.layout="auto") for the nodes the cluster
    may reach: (the config at its layout, the reach, the profile the pick was priced on)."""
    ensure_ray(cfg, cfg.parallelism.world_size)
    marks["ray_ready"] = time.time()
    # The live nodes and those an autoscaler may add; the planner's pick for them, said with its runner-up.
    reach = cluster_reach(bool(ray_address(cfg)), cfg.cluster.accelerator_type)
    cfg, layout_hw = choose_layout(cfg, say, reach, use_gpu_for(cfg, reach.nodes))
    return cfg, reach, layout_hw


def check_before_ray(cfg: Config, say=print) -> tuple[Config, bool]:
    """The checks `train` makes before Ray starts, and `check` makes the same: the pretrained
    checkpoint's weights, a machine given far more workers than cores (said), the input
    (launch.inputs.check_input). Returns the config with data.path resolved and whether the
    input's check is whole (what is left needs Ray: launch.inputs.finish_input)."""
    check_weights(cfg)
    if warning := crowded(cfg):
        say(warning)
    return check_input(cfg, say)


def plan_start(
    cfg: Config,
    point: ResumePoint,
    marks: dict,
    say=print,
    *,
    input_whole: bool | None = None,
    asked: Config | None = None,
) -> RunPlan:
    """Ray joined, the layout picked, the placement checked against the live nodes, the output
    directory made and the input checked: the run's RunPlan (ConfigError/LayoutError if none).
    ``input_whole``: ``cfg``'s input was checked before Ray started (check_before_ray), whole or
    not; None: not yet. ``asked``: the config as loaded (default ``cfg``)."""
    cfg, reach, layout_hw = open_session(cfg, marks, say)

    def ready(cfg: Config) -> Config:
        open_store(cfg.run.output_dir).makedirs()  # only now: a refused run leaves nothing behind
        if input_whole is None:
            return prepare_input(cfg, say=say)
        return finish_input(cfg, input_whole, say)

    plan = derive_plan(cfg, point, reach, layout_hw, say, ready=ready, asked=asked)
    marks["input_checked"] = time.time()
    return plan


def derive_plan(
    cfg: Config,
    point: ResumePoint,
    reach: Reach,
    layout_hw: Hardware | None,
    say=print,
    *,
    ready=None,
    placement: list[int] | None = None,
    checked: bool = True,
    lease: str = RunPlan.lease,
    unverified: list[str] | None = None,
    asked: Config | None = None,
) -> RunPlan:
    """The plan of ``cfg`` (at its layout) on the nodes of ``reach``, the one derivation `train`
    and `check` share: the worker counts, whether they use GPUs, what each asks of Ray, where
    they are placed and the steps trained. ``placement``: None, predicted for the live nodes and,
    ``checked``, checked against them (check_placement); else the workers per node given
    (`check --topology`). ``ready``: makes the output directory and prepares the input (the
    driver's; `check` writes nothing). ``unverified`` (`check`): rows that cannot be counted here
    are noted there, not refused. ``asked``: the config as loaded (default ``cfg``)."""
    counts = worker_counts(cfg)
    use_gpu = resolve_use_gpu(cfg, counts[0], reach.nodes)  # an elastic run starts on fewer
    resources = worker_resources(cfg, use_gpu)
    if placement is None and checked:
        placement = check_placement(cfg, resources, reach.live, counts)
    elif placement is None:  # `check`: the prediction alone (the weights and the output directory are not read)
        placement = predict_start(cfg, resources, reach.live, counts)[1]
    if ready is not None:
        cfg = ready(cfg)
    try:
        end = steps_to_train(cfg)
    except (OSError, ValueError) as exc:  # pyarrow's errors: a bucket out of reach, files not Parquet
        if unverified is None:
            raise
        unverified.append(f"data.path={cfg.data.path!r}: its rows were not counted here ({exc})")
        end = cfg.train.steps
    data_env = {}  # `check` lists no bucket again (its check of the input has read what it could)
    if ready is not None or not (is_uri(cfg.data.path) and not cfg.data.path.startswith("file://")):
        try:
            data_env = reader_env(cfg)
        except (OSError, ValueError):  # `check`: files not there yet (train prepares them) or said as not verified
            if unverified is None:
                raise
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
    )
