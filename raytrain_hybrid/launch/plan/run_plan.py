"""The run plan: what a run is, derived once on the driver (launch.runtime.start derives it), as plain
frozen data: `check` prints it, `train` runs it, and every worker gets its WorkerPlan
(engine.plan). Nothing here joins Ray, reads storage or writes anything.
"""

from __future__ import annotations

import dataclasses
import uuid

from raytrain_hybrid.config import Config
from raytrain_hybrid.config.elastic import is_elastic
from raytrain_hybrid.engine.plan import WorkerPlan
from raytrain_hybrid.launch.plan.reach import Reach
from raytrain_hybrid.models.params import sequence_parallel_line
from raytrain_hybrid.planner.hardware import Hardware
from raytrain_hybrid.storage import is_uri, open_store


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint (None: from scratch), the metrics history to keep,
    the run's trajectory record (checkpoint.trajectory) and the step its data began at."""

    path: str | None
    history: list[dict]
    trajectory: dict
    data_origin: int = 0
    step: int = 0  # the checkpoint's steps done
    # None left to train (its last step's checkpoint): the resume completes the run's records, no more.
    finished: bool = False


@dataclasses.dataclass(frozen=True)
class DataSource:
    """The run's input as `train` checked it before Ray starts (launch.plan.inputs.check_input): where its
    rows are (data.path resolved), and what the check read of them."""

    path: str  # data.path resolved: "memory", a Parquet file, a directory of them, a URI
    format: str  # data.format: text, chat, prompt_completion
    columns: tuple[str, ...] = ()  # the Parquet schema's columns (empty: "memory", or not read yet)
    rows: int | None = None  # the rows the check counted (None: not counted before the run)
    files: int | None = None  # the Parquet files (sizes Ray Data's footer readers: launch.plan.inputs.reader_env)
    # The check is whole; False: what is left is done once Ray is up (launch.runtime.start.start_run): the
    # shipped corpus prepared into ``path`` the first time, chat rows too many to encode on the driver.
    checked: bool = True
    shipped: bool = False  # the shipped corpus (data.path "builtin"), tokenized into its cache

    def line(self) -> str:
        """The input as `check` prints it."""
        if self.path == "memory":
            return "data memory (random tokens made on the workers)"
        read = f"{len(self.columns)} columns ({', '.join(self.columns)})" if self.columns else "columns not read yet"
        rows = f"{self.rows:,} rows" if self.rows is not None else "rows counted when the run starts"
        files = f" in {self.files} file{'s' * (self.files != 1)}" if self.files is not None else ""
        left = "" if self.checked else "; the rest of its check when the run starts, on Ray"
        return f"data {self.path}: {self.format}, {rows}{files}, {read}{left}"


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
    data_env: dict[str, str] = dataclasses.field(default_factory=dict)  # Ray Data's readers' (launch.plan.inputs)
    registered_models: tuple = ()  # models registered from Python (models.custom): each worker registers them again
    unverified: tuple[str, ...] = ()  # what `check` could not read here (no network, no credentials)
    # Written into every manifest of this launch: a restart tells its own checkpoints apart.
    launch_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    data: DataSource | None = None  # the input as checked before Ray starts (None: not checked, `check` offline)

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
            "data": dataclasses.asdict(self.data) if self.data is not None else None,
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
        lines = [data] + ([f"plan: {self.data.line()}"] if self.data is not None else [])
        sp = sequence_parallel_line(self.cfg)  # at tp > 1: whether the norms and residual split by sequence
        lines += [f"plan: {sp}"] if sp else []
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
