"""The ``[parallelism]`` section: how the run is laid out over ranks, and the layout keys that
plans, sweeps and checkpoints report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from raytrain_hybrid.config.coerce import choices
from raytrain_hybrid.errors import ConfigError

# Pipeline schedules from torch.distributed.pipelining that this project drives.
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES + V_SCHEDULES
ZERO_STAGES = (0, 1, 2, 3)
AC_MODES = (False, True, "selective")  # parallelism.activation_checkpointing: none, full, selective


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    # Data-parallel degree (replicas); the outermost split of the global batch.
    dp: int = 2
    # Elastic: with 0 < min_dp < dp, any dp in [min_dp, dp] keeping the micro-batch (`check` lists them); 0: fixed.
    min_dp: int = 0
    # "auto": the planner picks dp (at most the dp above), tp, pp, micro-batches, schedule, ZeRO and recompute
    # for the nodes there are (`check` shows it): at the start, or with min_dp at every start of the group
    # for all the workers Ray gave it (whole replicas of the tp*pp here, as when fixed). "fixed": these keys.
    layout: str = "fixed"
    # Tensor-parallel degree; every TP group stays inside one node.
    tp: int = 2
    # Pipeline-parallel degree (number of ranks along the pipeline).
    pp: int = 2
    # Context-parallel degree: each rank of a replica holds 1/cp of every sequence (inputs, labels,
    # activations) and attention exchanges heads for sequence over the cp ranks (all-to-all); cp x tp
    # stays inside a node where it fits. Gradients are averaged over dp x cp.
    cp: int = 1
    # Micro-batches per step and replica; the pipeline schedule runs this many.
    microbatches: int = 4
    # Pipeline schedule from torch.distributed.pipelining, by name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
    # InterleavedZeroBubble, ZBVZeroBubble, DualPipeV.
    schedule: str = "1F1B"
    # Model chunks per pipeline rank for multi-stage schedules (Interleaved1F1B, ...).
    # 0 means "pick": 2 for multi-stage and V schedules, 1 otherwise.
    virtual_stages: int = 0
    # 0 = DDP-style replication, 1 = optimizer state and update sharded over dp (ZeRO-1),
    # 2 = FSDP2 without resharding after forward, 3 = FSDP2 full sharding.
    zero: int = 0
    # Hybrid sharding (zero=1/2/3): dp = replicate x shard. ZeRO shards the state inside a shard group of
    # dp/replicate consecutive dp ranks (inside a node where it fits) and keeps replicate copies of it, one per
    # replica group, whose gradients are all-reduced across them each step (TorchTitan's
    # data_parallel_replicate_degree). 1: shard over all of dp.
    replicate: int = 1
    # Activation checkpointing of each transformer block: true (full) recomputes the whole block in
    # backward; "selective" keeps matmul, attention and TP-collective outputs and recomputes the
    # element-wise ops (norms, activations, RoPE); false (none) stores every activation.
    activation_checkpointing: bool | Literal["selective"] = False
    # torch.compile each transformer block (applied after TP and activation checkpointing, before
    # FSDP/ZeRO, as TorchTitan does); "auto" (the default): on when the workers have GPUs, off on CPU and for
    # mixtures of experts (their routing gives each step new shapes).
    compile: bool | None = None
    # Compile warm starts: keep torch.compile's caches (inductor's generated and compiled kernels,
    # AOTAutograd's graphs) in the run directory, one archive a rank under compile_cache/, written
    # after the first step, and load them when the run restarts or resumes there: that first step
    # then skips code generation and compilation. The archive is compiled code the workers load and
    # run: enable it only for a run directory you trust as much as the code.
    compile_cache: bool = False
    # With tp > 1: shard norms and the residual stream along the sequence across the TP
    # group (all-gather / reduce-scatter at the TP regions) so those activations shrink by
    # tp too. No effect at tp = 1.
    sequence_parallel: bool = True
    # Expert parallelism (mixture-of-experts models): each expert lives on one of ep ranks taken from the
    # data-parallel ones (ep divides dp and the model's experts), tokens sent to their experts by all-to-all.
    ep: int = 1

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "cp", "microbatches", "ep", "replicate"):
            value = getattr(self, key)
            if value < 1:
                raise ConfigError(f"parallelism.{key}", value, "must be >= 1")
        if self.min_dp < 0:
            raise ConfigError("parallelism.min_dp", self.min_dp, "must be >= 0 (0: a fixed dp)")
        if self.layout not in ("fixed", "auto"):
            raise ConfigError("parallelism.layout", self.layout, "must be one of {auto, fixed}")
        for key, allowed in (("activation_checkpointing", AC_MODES), ("compile", (None, True, False))):
            if getattr(self, key) not in allowed:  # (--set and TOML values are checked on the way in)
                raise ConfigError(f"parallelism.{key}", getattr(self, key), f"must be one of {choices(allowed)}")
        if self.compile_cache and self.compile is False:
            raise ConfigError(
                "parallelism.compile_cache", True, "keeps compiled kernels, and parallelism.compile=false compiles none"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError("parallelism.schedule", self.schedule, f"must be one of {choices(SCHEDULES)}")
        if self.zero not in ZERO_STAGES:
            raise ConfigError("parallelism.zero", self.zero, f"must be one of {choices(ZERO_STAGES)}")
        if self.virtual_stages < 0:
            raise ConfigError("parallelism.virtual_stages", self.virtual_stages, "must be >= 0 (0 picks a default)")
        if self.schedule in V_SCHEDULES and self.virtual_stages not in (0, 2):
            raise ConfigError(
                "parallelism.virtual_stages", self.virtual_stages, f"{self.schedule} needs exactly 2 (a V layout)"
            )
        if self.schedule in SINGLE_STAGE_SCHEDULES and self.virtual_stages > 1:
            raise ConfigError(
                "parallelism.virtual_stages",
                self.virtual_stages,
                f"{self.schedule} holds one stage per rank; use 1, or a multi-stage schedule "
                f"{choices(MULTI_STAGE_SCHEDULES)}",
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def stages_per_rank(self) -> int:
        if self.virtual_stages:
            return self.virtual_stages
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank


# A run's layout: the ParallelismConfig keys the planner searches and a sweep pins, in the
# order sweeps write them. Each output that reports a layout picks its keys from these (and
# "virtual_stages") with layout_dict, keeping the keys and order it has always written.
LAYOUT_KEYS = ("dp", "tp", "pp", "microbatches", "schedule", "zero", "activation_checkpointing", "sequence_parallel")


def layout_dict(par: ParallelismConfig, keys: Iterable[str] = LAYOUT_KEYS) -> dict[str, Any]:
    """``{key: value}`` of ``par`` for ``keys`` in their order: any of LAYOUT_KEYS, and
    "virtual_stages" as the model chunks each pipeline rank holds (0 resolved: 1 or 2)."""
    values = {key: getattr(par, key) for key in LAYOUT_KEYS} | {"virtual_stages": par.stages_per_rank}
    return {key: values[key] for key in keys}
