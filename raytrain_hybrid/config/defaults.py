"""Defaults that depend on other keys, filled in one explicit step between parsing and validation.

"0 picks" keys (model.num_kv_heads, model.ffn_hidden_size, train.lr), a classifier's columns
on the shipped data (data.text_columns, data.tabular_columns), and the architecture and sizes a
pretrained checkpoint fixes (a language model's Hugging Face directory: models.hf_checkpoint):
each is the architecture spec's to say. This is the one step that reads a file (the
checkpoint's config.json); run directories and checkpoint manifests save the
resolved config, so resolving one again changes nothing.
"""

from __future__ import annotations

import dataclasses

from raytrain_hybrid.config.schema import Config, DataConfig, ModelConfig
from raytrain_hybrid.models import get_arch, hf_checkpoint
from raytrain_hybrid.models.spec import ArchSpec


def resolve_defaults(cfg: Config, given: set[str] | None = None, unverified: list[str] | None = None) -> Config:
    """A new config with every default that depends on other keys filled in. ``given``: the
    ``model.*`` keys the user named (None: those that differ from their defaults);
    ``unverified``: where a checkpoint that cannot be read here is noted instead of refused."""
    # A language model's checkpoint fixes the architecture and sizes first (model.pretrained).
    cfg = dataclasses.replace(cfg, model=hf_checkpoint.resolve(cfg.model, given, unverified))
    spec = get_arch(cfg.model.arch)
    # Fine-tuning a pretrained language model takes TRL's learning rate, not pretraining's.
    finetune = hf_checkpoint.is_set(cfg.model.pretrained) and spec.from_hf is not None
    lr = hf_checkpoint.FINETUNE_LR if finetune else spec.default_lr
    train = cfg.train if cfg.train.lr else dataclasses.replace(cfg.train, lr=lr)
    return dataclasses.replace(
        cfg, model=_resolve_model(cfg.model, spec), train=train, data=_resolve_data(cfg.data, spec)
    )


def _resolve_model(model: ModelConfig, spec: ArchSpec) -> ModelConfig:
    # The checkpoint's sizes replace the user's (its num_kv_heads too), before the picks below.
    model = dataclasses.replace(model, **spec.checkpoint_sizes(model))
    picks = {}
    if not model.num_kv_heads:
        picks["num_kv_heads"] = model.num_heads
    if not model.ffn_hidden_size:
        picks["ffn_hidden_size"] = spec.default_ffn(model.hidden_size)
    return dataclasses.replace(model, **picks)


def _resolve_data(data: DataConfig, spec: ArchSpec) -> DataConfig:
    if data.path not in ("builtin", "memory"):
        return data
    # The shipped data's columns unless the user named others.
    return dataclasses.replace(
        data, **{key: getattr(data, key) or list(cols) for key, cols in spec.builtin_columns.items()}
    )
