"""What an architecture contributes: its config, its TP plan and its pipeline boundaries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    name: str
    # ModelConfig -> transformers PretrainedConfig (untied embeddings, sdpa attention).
    hf_config: Callable[[Any], Any]
    # PretrainedConfig -> the transformers model in the project's layout (see to_hf).
    build: Callable[[Any], Any]
    # Dotted path of the ModuleList of transformer blocks.
    layers: str
    # Modules that live on the first stage (embeddings) and on the last (final norm, head).
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    # Per block: submodule -> "colwise" | "rowwise" (DTensor Colwise/RowwiseParallel).
    tp_plan: dict[str, str]
    # Per stage, outside the blocks: module path -> "embedding" (vocab-sharded rows,
    # all-reduced output) | "head" (vocab-sharded columns, logits gathered).
    tp_plan_outer: dict[str, str] = field(default_factory=dict)
    # Added with sequence parallelism: per block, the norms ("norm": SequenceParallel) and the
    # modules whose input is all-gathered ("gather", or "gather:<keyword>" when passed by name);
    # per stage, the same for the final norm (and any position embedding to shard by sequence).
    sp_plan: dict[str, str] = field(default_factory=dict)
    sp_plan_outer: dict[str, str] = field(default_factory=dict)
    # Adjust per-block attributes that count local heads or widths after TP (block, tp).
    tp_adjust: Callable[[Any, int], None] | None = None
    # Run one pipeline stage: (stage module, input ids or hidden states) -> output.
    stage_forward: Callable[[Any, Any], Any] = field(repr=False, default=None)
    # Recreate non-persistent buffers after materialising from the meta device (stage, config, device).
    init_buffers: Callable[[Any, Any, Any], None] | None = None
    # Project state dict -> the unmodified transformers model's state dict.
    to_hf: Callable[[dict], dict] = lambda sd: dict(sd)
    # Extra config checks for this architecture (ModelConfig -> None or ConfigError).
    check: Callable[[Any], None] = lambda model_cfg: None
    # "lm": next-token prediction on a token stream; "classify": one label per row.
    task: str = "lm"
    # Blocks in the ModuleList at ``layers`` (ModelConfig -> int): what the pipeline splits.
    num_blocks: Callable[[Any], int] = lambda model_cfg: model_cfg.num_layers
    # Modules that live on the stage holding a given block (hf_config -> {module path: block}),
    # for models whose inputs enter mid-chain (a second encoder's embeddings).
    anchors: Callable[[Any], dict[str, int]] = lambda hf_config: {}
    # The full initial values of a stage's parameters, when not all drawn from the seed
    # (Config, stage module, {name: shape}) -> {name: tensor}: pretrained weights.
    initial_state: Callable[[Any, Any, dict], dict] | None = None
    # Example (inputs, outputs) of a pipeline stage, when its I/O cannot be inferred by running
    # it on uninitialised tensors: (hf_config, block ids, micro-batch rows, seq_len, device).
    stage_io: Callable[..., tuple[tuple, tuple]] | None = None
