"""The multimodal classifier of the design documents: two BERT text encoders, a tabular
network and a fusion head, built from unmodified transformers modules (BertEmbeddings,
BertLayer).

Pipeline split. torch.distributed.pipelining runs a chain of stages, so the two text
branches are laid end to end: blocks 0..L-1 are encoder A's layers, L..2L-1 encoder B's,
and the chain is cut into balanced runs of blocks like any other model. With pp=2 the cut
falls between the encoders, which is the design document's split by branch (stage 0: the
first text branch, stage 1: the second branch, tabular features and fusion); deeper
pipelines cut inside the encoders too. A branch split alone could not go past pp=2 nor
balance encoders of different depth. The tabular network runs on the first stage (its
input is there) and its output travels with the hidden states, so everything carried
between stages that is a float is an activation with a gradient.

Dropout is off (as in the other models) so every layout computes the same function.
"""

from __future__ import annotations

from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.models.pretrained import encoder_sizes, read_config
from raytrain_hybrid.models.spec import ArchSpec, TransformersClass


class _Code(TransformersClass):
    """A function or class of the model code (models.multimodal_bert_model), imported when first
    called: a config's defaults and checks (every `check`) cost no import of torch and
    transformers' BERT (seconds of CPU)."""

    def load(self):
        from raytrain_hybrid.models import multimodal_bert_model

        return getattr(multimodal_bert_model, self.name)

    def __repr__(self) -> str:
        return f"raytrain_hybrid.models.multimodal_bert_model.{self.name}"


# What travels between stages, by the index of the next block to run (L blocks per encoder).
def carried(next_block: int, layers: int) -> tuple[str, ...]:
    if next_block == 0:
        return ("ids_a", "mask_a", "ids_b", "mask_b", "tabular")  # the batch, into the first stage
    if next_block < layers:
        return ("h", "mask_a", "ids_b", "mask_b", "tab_h")
    if next_block == layers:
        return ("pooled_a", "ids_b", "mask_b", "tab_h")
    return ("h", "mask_b", "pooled_a", "tab_h")


def checkpoint_name(name: str, layers: int) -> str | None:
    """Project parameter name -> name in a BertModel checkpoint (None: not in it)."""
    head, _, rest = name.partition(".")
    if head in ("embeddings_a", "embeddings_b"):
        return f"embeddings.{rest}"
    if head == "layers":
        index, _, rest = rest.partition(".")
        return f"encoder.layer.{int(index) % layers}.{rest}"
    return None  # tabular network and fusion head: new, drawn from the seed


def checkpoint_sizes(m) -> dict:
    """The encoder sizes of the pretrained checkpoint; a seq_len past its positions is refused here,
    where its config.json is read."""
    if m.pretrained.lower() == "none":
        return {}
    conf = read_config(m.pretrained)
    limit = conf.get("max_position_embeddings")
    if limit and m.seq_len > limit:
        raise ConfigError("model.seq_len", m.seq_len, f"exceeds the checkpoint's {limit} positions; use <= {limit}")
    return encoder_sizes(conf)


def check(cfg) -> None:
    m, data = cfg.model, cfg.data
    if m.num_classes < 2:
        raise ConfigError("model.num_classes", m.num_classes, "must be >= 2 (2 is a binary classifier)")
    if m.class_weights and len(m.class_weights) != m.num_classes:
        raise ConfigError(
            "model.class_weights",
            m.class_weights,
            f"needs one weight per class, {m.num_classes} (model.num_classes), or none",
        )
    if any(w < 0 for w in m.class_weights):
        raise ConfigError("model.class_weights", m.class_weights, "weights must be >= 0")
    for key in ("tabular_hidden_size", "fusion_hidden_size"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key}", getattr(m, key), "must be >= 1")
    # Labelled rows: a text column per encoder, numeric features, an integer label.
    if len(data.text_columns) != 2:
        raise ConfigError(
            "data.text_columns",
            data.text_columns,
            f'{m.arch} has two text encoders: name two text columns, e.g. ["dialogue", "shiptrack"]',
        )
    if not data.tabular_columns:
        raise ConfigError("data.tabular_columns", [], "name at least one numeric column for the tabular network")
    if not data.label_column:
        raise ConfigError("data.label_column", "", "name the integer label column")
    if data.text_column:
        raise ConfigError(
            "data.text_column", data.text_column, f"is for language models; {m.arch} reads data.text_columns"
        )


def embedding_params(m) -> int:
    """One encoder's embeddings: words, 512 positions, 2 token types, LayerNorm."""
    h = m.hidden_size
    return m.vocab_size * h + max(512, m.seq_len) * h + 2 * h + 2 * h


def param_parts(m) -> tuple[int, int, int]:
    """The first stage's extra is encoder A's embeddings and the tabular network; encoder B's
    embeddings sit with its first block (anchored_params)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # BERT block: like GPT-2's
    th, fh = m.tabular_hidden_size, m.fusion_hidden_size
    tabular = 3 * th + th + th * th + th  # three features is the shipped set's width
    head = (2 * h + th) * fh + fh + fh * m.num_classes + m.num_classes
    return per_layer, embedding_params(m) + tabular, head


def matmul_params(m) -> int:
    """Per encoder: a row's tokens pass through one of the two."""
    h = m.hidden_size
    return m.num_layers * (4 * h * h + 2 * h * m.ffn_hidden_size)


SPEC = ArchSpec(
    name="multimodal-bert",
    hf_config=_Code("hf_config"),
    build=_Code("MultimodalBert"),
    layers="layers",
    first_stage=("embeddings_a", "tabular"),
    last_stage=("head",),
    # Megatron's split of a BERT block: q, k, v and the MLP's first matrix by output
    # columns (heads / hidden units per rank), the two output projections by input rows;
    # one all-reduce per attention and per MLP. Embeddings, LayerNorms, the tabular
    # network and the head stay replicated (small; their inputs are whole on every rank).
    tp_plan={
        "attention.self.query": "colwise",
        "attention.self.key": "colwise",
        "attention.self.value": "colwise",
        "attention.output.dense": "rowwise",
        "intermediate.dense": "colwise",
        "output.dense": "rowwise",
    },
    tp_adjust=_Code("tp_adjust"),
    stage_forward=_Code("stage_forward"),
    init_buffers=_Code("init_buffers"),
    check=check,
    task="classify",
    default_lr=2e-4,  # fine-tuning pretrained encoders
    checkpoint_sizes=checkpoint_sizes,
    builtin_columns={
        "text_columns": ["dialogue", "shiptrack"],
        "tabular_columns": ["feature_1", "feature_2", "feature_3"],
    },
    param_parts=param_parts,
    anchored_params=lambda m: {m.num_layers: embedding_params(m)},
    matmul_params=matmul_params,
    text_fields=2,
    logits_per_row=lambda m: m.num_classes,  # a class per row, not a vocabulary per token
    num_blocks=lambda m: 2 * m.num_layers,
    anchors=lambda config: {"embeddings_b": config.num_hidden_layers},
    initial_state=_Code("initial_state"),
    stage_io=_Code("stage_io"),
)
