"""Checks across keys of a resolved config (layout against model and batch, data keys against the
model's task). ``validate`` reads no file and changes nothing; ``resolve_defaults`` runs first."""

from __future__ import annotations

import re

from raytrain_hybrid.config.coerce import choices, divisors
from raytrain_hybrid.config.elastic import check_elastic
from raytrain_hybrid.config.fault_tolerance import check_fault_tolerance
from raytrain_hybrid.config.fp8 import check_fp8
from raytrain_hybrid.config.lora import check_lora
from raytrain_hybrid.config.placeholders import refuse_placeholders
from raytrain_hybrid.config.schedule_rules import min_microbatches, too_few_microbatches, uneven_microbatches
from raytrain_hybrid.config.schema import (
    SINGLE_STAGE_SCHEDULES,
    Config,
    ModelConfig,
)
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import arch_names, get_arch
from raytrain_hybrid.models.spec import ArchSpec


def validate(cfg: Config) -> None:
    """Cross-key checks of a resolved config: the model, the layout against the model and the
    batch, the data keys against the model's task."""
    refuse_placeholders(cfg)  # a <your-bucket> left in a copied job file
    spec = get_arch(cfg.model.arch)
    _require_resolved(cfg)
    _validate_model(cfg, spec)
    _validate_layout(cfg, spec)
    _validate_experts(cfg, spec)
    _validate_cp(cfg, spec)
    _validate_replicate(cfg)
    check_elastic(cfg)  # parallelism.min_dp: the dp values below dp the layout allows
    _validate_task(cfg, spec)
    check_lora(cfg, spec)  # [lora]: a pretrained model, targets among its linears
    check_fp8(cfg)  # train.fp8: tp=1, no LoRA, a GPU unless emulated
    check_fault_tolerance(cfg)  # [fault_tolerance]: two replica groups or more, torchft installed
    _validate_run(cfg)


def _require_resolved(cfg: Config) -> None:
    picks = {
        "model.num_kv_heads": cfg.model.num_kv_heads,
        "model.ffn_hidden_size": cfg.model.ffn_hidden_size,
        "train.lr": cfg.train.lr,
    }
    left = [key for key, value in picks.items() if value == 0]
    if left:  # a caller's mistake, not the user's: 0 would pass every divisibility check below
        raise ValueError(f"validate() needs a resolved config ({', '.join(left)} = 0); call resolve_defaults first")


def _validate_model(cfg: Config, spec: ArchSpec) -> None:
    model = cfg.model
    if model.hidden_size % model.num_heads:
        raise ConfigError(
            "model.num_heads",
            model.num_heads,
            f"must divide model.hidden_size={model.hidden_size}; try one of {choices(divisors(model.hidden_size))}",
        )
    spec.check(cfg)
    # The Llama family's attention reads it, and every transformers family the generic path builds
    # (models.generic: on_stage), no other.
    if model.head_dim and spec.attention is None and spec.on_stage is None:
        raise ConfigError(
            "model.head_dim",
            model.head_dim,
            f"{model.arch}'s heads are model.hidden_size / model.num_heads wide; leave it out (0)",
        )
    if model.num_heads % model.num_kv_heads:
        raise ConfigError(
            "model.num_kv_heads",
            model.num_kv_heads,
            f"must divide model.num_heads={model.num_heads}; try one of {choices(divisors(model.num_heads))}",
        )


def _validate_layout(cfg: Config, spec: ArchSpec) -> None:
    par, model, train = cfg.parallelism, cfg.model, cfg.train
    tp = par.tp
    sharded = [
        ("model.num_heads", model.num_heads),
        ("model.num_kv_heads", model.num_kv_heads),
        ("model.ffn_hidden_size", model.ffn_hidden_size),
    ]
    if "embedding" in spec.tp_plan_outer.values():  # vocab-parallel embedding and head
        sharded.append(("model.vocab_size", model.vocab_size))
    for key, value in sharded:
        if value % tp:
            fits = [d for d in divisors(value) if d <= 64]
            raise ConfigError("parallelism.tp", tp, f"does not divide {key}={value}; try tp in {choices(fits)}")
    blocks = spec.num_blocks(model)
    if par.num_stages > blocks:
        what = f"pp={par.pp}" if par.stages_per_rank == 1 else f"pp*virtual_stages={par.pp}*{par.stages_per_rank}"
        have = f"model.num_layers={model.num_layers}" + (f" ({blocks} blocks)" if blocks != model.num_layers else "")
        raise ConfigError(
            "parallelism.pp",
            par.pp,
            f"{what} stages exceed {have}; every stage needs a block, "
            f"so use pp <= {blocks // par.stages_per_rank} or more layers",
        )
    if par.pp == 1 and par.schedule not in SINGLE_STAGE_SCHEDULES:
        raise ConfigError(
            "parallelism.schedule",
            par.schedule,
            f"needs pp >= 2; with pp=1 use one of {choices(SINGLE_STAGE_SCHEDULES)}",
        )
    if too_few_microbatches(par.schedule, par.pp, par.microbatches):
        raise ConfigError(
            "parallelism.microbatches",
            par.microbatches,
            f"{par.schedule} with pp={par.pp} needs at least {'2*pp' if par.schedule == 'DualPipeV' else 'pp'} "
            f"micro-batches; use microbatches >= {min_microbatches(par.schedule, par.pp)}",
        )
    if uneven_microbatches(par.schedule, par.pp, par.microbatches):
        raise ConfigError(
            "parallelism.microbatches",
            par.microbatches,
            f"{par.schedule} needs a multiple of pp={par.pp}; try {par.pp * max(1, par.microbatches // par.pp)}",
        )
    per_step = par.dp * par.microbatches
    if train.global_batch_size % per_step:
        good = per_step * max(1, round(train.global_batch_size / per_step))
        raise ConfigError(
            "train.global_batch_size",
            train.global_batch_size,
            f"must be divisible by dp*microbatches={par.dp}*{par.microbatches}={per_step}; try {good}",
        )
    if tp > 1 and par.sequence_parallel and spec.sequence_parallel and model.seq_len % tp:
        fits = [d for d in divisors(model.seq_len) if d <= 64]
        raise ConfigError(
            "parallelism.tp",
            tp,
            f"sequence parallelism splits model.seq_len={model.seq_len} across the TP group and tp does not "
            f"divide it; try tp in {choices(fits)} or parallelism.sequence_parallel=false",
        )
    cluster = cfg.cluster
    if tp > 1 and cluster.placement_strategy == "STRICT_SPREAD":
        raise ConfigError(
            "cluster.placement_strategy",
            "STRICT_SPREAD",
            f"puts every worker on its own node, so TP groups of tp={tp} would cross nodes; use PACK or tp=1",
        )
    gpn = cluster.gpus_per_node
    if gpn and cluster.use_gpu is not False and (tp > gpn or gpn % tp):
        fits = [d for d in divisors(gpn) if all(v % d == 0 for v in (model.num_heads, model.num_kv_heads))]
        raise ConfigError(
            "parallelism.tp",
            tp,
            f"TP groups must stay inside a node of cluster.gpus_per_node={gpn}; try tp in {choices(fits)}",
        )


def _validate_cp(cfg: Config, spec: ArchSpec) -> None:
    """Context parallelism: every rank of a cp group a contiguous slice of the sequence, and an
    equal share of the attention heads (after TP) for the all-to-all exchange."""
    par, model = cfg.parallelism, cfg.model
    cp, tp = par.cp, par.tp
    if cp == 1:
        return
    if spec.attention is None:
        raise ConfigError(
            "parallelism.cp",
            cp,
            f"model.arch={model.arch} has no context-parallel attention; use cp=1 (cp runs on the Llama family and "
            "the transformers families docs/models.md marks)",
        )
    if model.seq_len % cp:
        fits = [d for d in divisors(model.seq_len) if d <= 64]
        raise ConfigError(
            "parallelism.cp", cp, f"does not divide model.seq_len={model.seq_len}; try cp in {choices(fits)}"
        )
    if tp > 1 and par.sequence_parallel and spec.sequence_parallel and (model.seq_len // cp) % tp:
        raise ConfigError(
            "parallelism.cp",
            cp,
            f"sequence parallelism splits each cp slice (model.seq_len/cp={model.seq_len // cp}) across tp={tp}, "
            f"which does not divide it; use a model.seq_len that cp*tp={cp * tp} divides, or "
            "parallelism.sequence_parallel=false",
        )
    heads = model.num_heads // tp
    if heads % cp:
        raise ConfigError(
            "parallelism.cp",
            cp,
            f"does not divide the attention heads of a TP rank (model.num_heads/tp={model.num_heads}/{tp}={heads}), "
            f"which the cp ranks share out; try cp in {choices(divisors(heads))}",
        )


def _validate_experts(cfg: Config, spec: ArchSpec) -> None:
    """Expert parallelism against the model and the layout (distributed.expert_parallel)."""
    par, model = cfg.parallelism, cfg.model
    if spec.moe is None:  # an expert key set on a dense model would be silently ignored
        defaults = ModelConfig()
        for key in ("num_experts", "experts_per_token", "router_aux_loss_coef"):
            if getattr(model, key) != getattr(defaults, key):
                raise ConfigError(
                    f"model.{key}",
                    getattr(model, key),
                    f"only a mixture of experts reads it (model.arch mixtral or qwen3-moe); {model.arch} has no "
                    "experts: leave it out",
                )
    if par.ep == 1:
        return
    if spec.moe is None:
        raise ConfigError(
            "parallelism.ep", par.ep, f"needs a mixture-of-experts model.arch (mixtral, qwen3-moe), not {model.arch}"
        )
    experts = spec.experts(model)[0]
    fits = [d for d in divisors(par.dp) if experts % d == 0]
    # (a generic family's experts are its config's, not model.num_experts: named so)
    hand = "router" in spec.moe and "logits" not in spec.moe
    counted = "model.num_experts" if hand else "the model's expert count"
    for key, value in (("parallelism.dp", par.dp), (counted, experts)):
        if value % par.ep:
            raise ConfigError("parallelism.ep", par.ep, f"must divide {key}={value}; try ep in {choices(fits)}")


def _validate_replicate(cfg: Config) -> None:
    """Hybrid sharding: replicate x shard = dp, over a ZeRO stage that shards something."""
    par = cfg.parallelism
    if par.replicate == 1:
        return
    if par.dp % par.replicate:
        fits = choices(divisors(par.dp))
        raise ConfigError("parallelism.replicate", par.replicate, f"must divide dp={par.dp}; try replicate in {fits}")
    if par.zero == 0:  # nothing is sharded: every dp rank already holds a whole copy
        raise ConfigError(
            "parallelism.replicate",
            par.replicate,
            "splits dp into replica groups of sharded state, and zero=0 shards nothing (every dp rank is "
            "already a replica); use zero=1, 2 or 3 with it, or replicate=1",
        )
    for key, value, why in (
        ("ep", par.ep, "the experts are sharded over the dp/ep ranks holding them"),
        ("min_dp", par.min_dp, "an elastic run changes dp at each start"),
    ):
        if value > 1 or (key == "min_dp" and value):
            raise ConfigError(
                "parallelism.replicate",
                par.replicate,
                f"is not combined with parallelism.{key}={value} ({why}); use replicate=1 or {key}="
                + ("1" if key == "ep" else "0"),
            )


def _validate_task(cfg: Config, spec: ArchSpec) -> None:
    """Keys a language model does not read (they would switch the data path to labelled rows);
    a classifier's own keys are its spec's check."""
    if spec.task != "lm":
        if cfg.data.format != "text":
            raise ConfigError("data.format", cfg.data.format, f"is for language models, not {cfg.model.arch}")
        if cfg.data.packing:
            raise ConfigError(
                "data.packing",
                True,
                f"is for language models; {cfg.model.arch} takes one labelled row a sample: use false",
            )
        return
    if cfg.data.format != "text" and cfg.data.path == "memory":
        raise ConfigError(
            "data.format",
            cfg.data.format,
            "needs data.path to name Parquet files with its columns; data.path=memory is the shipped text corpus",
        )

    # Named only in a refusal: listing them imports every spec's module (torch, transformers).
    def classifiers() -> str:
        return ", ".join(arch_names("classify"))

    if cfg.train.eval_interval:
        raise ConfigError(
            "train.eval_interval", cfg.train.eval_interval, f"evaluation is for classifiers ({classifiers()}); use 0"
        )
    for key in ("text_columns", "tabular_columns", "val_path"):
        if getattr(cfg.data, key):
            raise ConfigError(
                f"data.{key}", getattr(cfg.data, key), f"is for classifiers ({classifiers()}), not {cfg.model.arch}"
            )


# What ray.init joins: auto, local, host:port (a GCS), ray://host:port (Ray Client).
RAY_ADDRESS_FORM = re.compile(r"auto|local|(ray://)?[A-Za-z0-9_.\-\[\]:]+:\d+")


def _validate_run(cfg: Config) -> None:
    """run.shared_fs declares a mounted directory shared; a URI is shared by what it is; a
    cluster.address has a form Ray joins (a dashboard's http:// address: launch.plan.address says why not)."""
    address = cfg.cluster.address.strip()
    if address and not RAY_ADDRESS_FORM.fullmatch(address) and not address.lower().startswith(("http://", "https://")):
        raise ConfigError(
            "cluster.address",
            address,
            "is not a Ray address: give HOST:PORT (the head's GCS, e.g. 10.0.0.1:6379), auto, local or ray://HOST:PORT",
        )
    steps, last = cfg.train.steps, cfg.run.profile_steps[-1:]
    if last and last[0] > steps:
        first = min(cfg.run.profile_steps[0], steps)
        raise ConfigError(
            "run.profile_steps",
            cfg.run.profile_steps,
            f"ends after train.steps={steps}, the run's last step; use steps within 1..{steps}, "
            f"e.g. [{first}, {min(first + 2, steps)}]",
        )
    if cfg.run.shared_fs and "://" in cfg.run.output_dir:
        raise ConfigError(
            "run.shared_fs",
            True,
            f"is for a directory mounted on every node; run.output_dir={cfg.run.output_dir} is object storage, "
            "which every node reaches already: leave run.shared_fs=false",
        )
