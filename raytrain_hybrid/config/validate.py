"""Checks across sections (layout against model and batch, data keys against the model's task)."""

from __future__ import annotations

from raytrain_hybrid.config.coerce import choices, divisors
from raytrain_hybrid.config.schema import (
    CLASSIFIERS,
    MULTI_STAGE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    Config,
)
from raytrain_hybrid.errors import ConfigError


def validate(cfg: Config) -> None:
    """Cross-section checks: the layout against the model and the batch."""
    from raytrain_hybrid.models import get_arch  # local: models import torch, config must stay light

    par, model, train = cfg.parallelism, cfg.model, cfg.train
    spec = get_arch(model.arch)
    if train.lr == 0:
        train.lr = 2e-4 if model.arch in CLASSIFIERS else 3e-3
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
    if par.pp > 1 and par.microbatches < par.pp and par.schedule != "GPipe":
        raise ConfigError(
            "parallelism.microbatches",
            par.microbatches,
            f"{par.schedule} with pp={par.pp} needs at least pp micro-batches; use microbatches >= {par.pp}",
        )
    if par.schedule in MULTI_STAGE_SCHEDULES + V_SCHEDULES and par.microbatches % par.pp:
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
    if tp > 1 and par.sequence_parallel and spec.sp_plan and model.seq_len % tp:
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
    spec.check(model)
    _validate_task(cfg)


def _validate_task(cfg: Config) -> None:
    """Data keys against the kind of model: token streams for LMs, labelled rows for classifiers."""
    data, model = cfg.data, cfg.model
    if model.arch not in CLASSIFIERS:
        if cfg.train.eval_interval:
            raise ConfigError(
                "train.eval_interval", cfg.train.eval_interval, "evaluation is for classifiers (multimodal-bert); use 0"
            )
        for key in ("text_columns", "tabular_columns", "val_path"):  # these make the data path read rows
            if getattr(data, key):
                raise ConfigError(
                    f"data.{key}", getattr(data, key), f"is for classifiers (multimodal-bert), not {model.arch}"
                )
        return
    if data.path in ("builtin", "memory"):  # the shipped shipments set: its columns unless the user named others
        data.text_columns = data.text_columns or ["dialogue", "shiptrack"]
        data.tabular_columns = data.tabular_columns or ["feature_1", "feature_2", "feature_3"]
    if len(data.text_columns) != 2:
        raise ConfigError(
            "data.text_columns",
            data.text_columns,
            f'{model.arch} has two text encoders: name two text columns, e.g. ["dialogue", "shiptrack"]',
        )
    if not data.tabular_columns:
        raise ConfigError("data.tabular_columns", [], "name at least one numeric column for the tabular network")
    if not data.label_column:
        raise ConfigError("data.label_column", "", "name the integer label column")
    if data.text_column:
        raise ConfigError(
            "data.text_column", data.text_column, f"is for language models; {model.arch} reads data.text_columns"
        )
