"""What an architecture contributes: its config, its TP plan, its pipeline boundaries, its
defaults, its parameter and FLOP counts. Code outside ``models/`` reads these fields and never
matches an architecture by name, so a new architecture is a new spec."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class TransformersClass:
    """A class of ``transformers`` named here and imported when first called: a spec, and so a
    config's defaults and checks (every CLI command, every driver), costs no import of
    transformers and its model code (~1.5 s of CPU, DTensor's operator tables included)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def load(self) -> type:
        import transformers

        return getattr(transformers, self.name)

    def __call__(self, *args, **kwargs):
        return self.load()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"transformers.{self.name}"


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
    # Or a block's plan read off its own modules (block -> {child: style}; the generic families,
    # models.generic_sp), merged over sp_plan. Sequence parallelism runs where either is set.
    sp_block: Callable[[Any], dict[str, str]] | None = None
    # Adjust per-block attributes that count local heads or widths after TP (block, tp).
    tp_adjust: Callable[[Any, int], None] | None = None
    # Run one pipeline stage: (stage module, input ids or hidden states) -> output.
    stage_forward: Callable[[Any, Any], Any] = field(repr=False, default=None)
    # Recreate non-persistent buffers after materialising from the meta device (stage, config, device).
    init_buffers: Callable[[Any, Any, Any], None] | None = None
    # Project state dict -> the unmodified transformers model's state dict.
    to_hf: Callable[[dict], dict] = lambda sd: dict(sd)
    # Extra checks of a resolved Config for this architecture (Config -> None or ConfigError);
    # reads no files.
    check: Callable[[Any], None] = lambda cfg: None
    # "lm": next-token prediction on a token stream; "classify": one label per row.
    task: str = "lm"
    # The unmodified transformers class ``export`` writes (called with hf_config); None: the
    # model is not one transformers class and is not exported.
    hf_class: Callable[[Any], Any] | None = None
    # Defaults that "0 picks" resolves (config.resolve_defaults): the peak learning rate, and
    # the MLP width for a model width (hidden_size -> ffn_hidden_size).
    default_lr: float = 3e-3
    default_ffn: Callable[[int], int] = lambda hidden: 4 * hidden
    # The sizes a pretrained checkpoint fixes (ModelConfig -> {key: value}; {} without one).
    # It reads the checkpoint's config.json: resolve_defaults is the one caller.
    checkpoint_sizes: Callable[[Any], dict] = lambda model_cfg: {}
    # Hugging Face checkpoints (model.pretrained, models.hf_checkpoint): the config.json
    # model_types this spec builds; config.json -> {model.* size key: value}; the longest
    # sequence the checkpoint attends over (config.json -> int, 0: no limit); and where an
    # engine parameter's values lie in the checkpoint: (engine name, config.json) ->
    # (candidate keys, the first present is read; transposed; offset of the block in the
    # checkpoint tensor, () for the whole tensor). None: no Hugging Face checkpoints.
    hf_model_types: tuple[str, ...] = ()
    sizes_from_hf: Callable[[dict], dict] | None = None
    max_seq_len: Callable[[dict], int] = lambda conf: 0
    from_hf: Callable[[str, dict], tuple[tuple[str, ...], bool, tuple[int, ...]]] | None = None
    # With data.path "builtin" or "memory": the shipped data's columns, for the data keys the
    # user left empty ({key: columns}; language models read the shipped token corpus instead).
    builtin_columns: dict[str, list[str]] = field(default_factory=dict)
    # Counts from the config alone (planner, MFU), each ModelConfig -> int:
    # parameters as (per block, first stage extra, last stage extra),
    param_parts: Callable[[Any], tuple[int, int, int]]
    # parameters that live with one block beyond its own ({block: count}: a second encoder's
    # embeddings sit with that encoder's first block),
    anchored_params: Callable[[Any], dict[int, int]] = lambda model_cfg: {}
    # weights a token meets in matmuls (6 FLOPs each in training, see models.flops),
    matmul_params: Callable[[Any], int]
    # token sequences of seq_len per sample (a window: 1; a row of two text fields: 2),
    text_fields: int = 1
    # and logits per sample (held in fp32 with their gradient on the last stage).
    logits_per_row: Callable[[Any], int] = lambda model_cfg: model_cfg.seq_len * model_cfg.vocab_size
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
    # Mixture of experts: inside each block, the router (its forward returns (logits, routing
    # weights, expert indices) for [tokens, hidden] input) and the experts (3D weights
    # gate_up_proj [E, 2F, H] and down_proj [E, H, F]; forward(hidden, indices, weights)), as
    # {"router": path, "experts": path}; None: a dense model.
    moe: dict[str, str] | None = None
    # Of param_parts' per-block count, the experts' weights (ModelConfig -> int): expert parallelism
    # shards them over ep, and they stay whole on every TP rank (the planner's memory and traffic).
    expert_params: Callable[[Any], int] = lambda model_cfg: 0
    # Of the per-block count, the rest of a mixture-of-experts block that every TP rank holds whole
    # and expert parallelism does not shard (a generic family's router and shared experts).
    whole_params: Callable[[Any], int] = lambda model_cfg: 0
    # Of the per-block count, outside a mixture of experts, the parameters no tensor-parallel style
    # splits (a generic family's modules its plan leaves out: MiniMax's linear attention): whole
    # on every TP rank, their FLOPs too.
    tp_whole_params: Callable[[Any], int] = lambda model_cfg: 0
    # The shares of blocks whose attention (Youtu's) and whose dense MLP the plan leaves whole: no
    # TP all-reduce of their own.
    tp_whole_attention: Callable[[Any], float] = lambda model_cfg: 0.0
    tp_whole_mlp: Callable[[Any], float] = lambda model_cfg: 0.0
    # (experts, experts a token is routed to) of a mixture of experts (ModelConfig -> ints): the
    # model.* keys of a hand-written spec; a generic family's own config (models.generic).
    experts: Callable[[Any], tuple[int, int]] = lambda m: (m.num_experts, m.experts_per_token)
    # Per block: the path of its attention module, a transformers attention that reads the config's
    # attention implementation, and a stage_forward that gives RoPE the positions of the stage's
    # ``seq_chunk`` (context parallelism runs only where this is set).
    attention: str | None = None
    # Whether the model ties its head to its token embedding (hf_config -> bool): the engine then
    # holds both, the head starting from the embedding's value, their gradients summed each step.
    tied: Callable[[Any], bool] = lambda hf_config: False
    # Parameters the engine holds beyond the model's own count, on the last stage (ModelConfig -> int):
    # a tied head's copy (engine.tied), which transformers counts once but every layout holds twice.
    held_copies: Callable[[Any], int] = lambda model_cfg: 0
    # Called by build_stage with (stage, the model it was cut from) after re-parenting its children.
    on_stage: Callable[[Any, Any], None] | None = None

    @property
    def sequence_parallel(self) -> bool:
        """Whether parallelism.sequence_parallel applies to this architecture at tp > 1."""
        return bool(self.sp_plan) or self.sp_block is not None

    def import_model_code(self) -> None:
        """Import the transformers classes the spec names (a worker does it with its imports,
        where its start-up breakdown counts it)."""
        for fn in (self.build, self.hf_class):
            if isinstance(fn, TransformersClass):
                fn.load()
