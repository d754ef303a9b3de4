"""The multimodal classifier's model code (models.multimodal_bert holds its spec): the modules,
built from unmodified transformers modules (BertEmbeddings, BertLayer), and what a worker runs
of them. Imported when a worker builds the model, not when a config is checked."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

from raytrain_hybrid.models.common import full_init_state_dict
from raytrain_hybrid.models.multimodal_bert import carried, checkpoint_name
from raytrain_hybrid.models.pretrained import load_tensors, read_config


class TabularNet(nn.Module):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc2(F.relu(self.fc1(x))))


class FusionHead(nn.Module):
    def __init__(self, width: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def mean_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over real tokens (the pooling all-MiniLM-L6-v2 was trained with)."""
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


def attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """[batch, seq] 1/0 -> [batch, 1, 1, seq] bool for sdpa: every query sees the real keys."""
    return mask[:, None, None, :].bool()


class MultimodalBert(nn.Module):
    """Parameter names: embeddings_a/b.*, layers.<0..2L-1>.*, tabular.*, head.*."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        layers = config.num_hidden_layers
        self.embeddings_a = BertEmbeddings(config)
        self.embeddings_b = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config, layer_idx=i % layers) for i in range(2 * layers))
        self.tabular = TabularNet(config.num_tabular_features, config.tabular_hidden_size)
        width = 2 * config.hidden_size + config.tabular_hidden_size
        self.head = FusionHead(width, config.fusion_hidden_size, config.num_classes)

    def encode(self, embeddings, layers, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = embeddings(input_ids=ids)
        for layer in layers:
            h = layer(h, attention_mask=attention_mask(mask))
        return mean_pool(h, mask)

    def forward(self, ids_a, mask_a, ids_b, mask_b, tabular) -> torch.Tensor:
        """Logits [batch, classes]: the plain, unpipelined forward (what the oracle runs)."""
        n = self.config.num_hidden_layers
        a = self.encode(self.embeddings_a, self.layers[:n], ids_a, mask_a)
        b = self.encode(self.embeddings_b, self.layers[n:], ids_b, mask_b)
        return self.head(torch.cat([a, b, self.tabular(tabular)], dim=-1))


def hf_config(cfg) -> BertConfig:
    m = cfg.model
    conf = read_config(m.pretrained)  # {} for random weights
    if not conf:
        conf = {
            "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_heads,
            "intermediate_size": m.ffn_hidden_size,
            "max_position_embeddings": m.seq_len,
        }
    conf = {k: v for k, v in conf.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    config = BertConfig(**{**conf, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    config._attn_implementation = "sdpa"
    config.num_tabular_features = len(cfg.data.tabular_columns)
    config.tabular_hidden_size = m.tabular_hidden_size
    config.fusion_hidden_size = m.fusion_hidden_size
    config.num_classes = m.num_classes
    return config


def stage_forward(stage, *xs: torch.Tensor):
    n = stage.hf_config.num_hidden_layers
    blocks = sorted(int(k) for k in stage.layers.keys())
    st = dict(zip(carried(blocks[0], n), xs, strict=True))
    if stage.tabular is not None:
        st["tab_h"] = stage.tabular(st.pop("tabular"))
    for i in blocks:
        if i == 0:
            st["h"] = stage.embeddings_a(input_ids=st.pop("ids_a"))
        if i == n:
            st["h"] = stage.embeddings_b(input_ids=st.pop("ids_b"))
        mask = st["mask_a"] if i < n else st["mask_b"]
        st["h"] = stage.layers[str(i)](st["h"], attention_mask=attention_mask(mask))
        if i == n - 1:
            st["pooled_a"] = mean_pool(st.pop("h"), st.pop("mask_a"))
        if i == 2 * n - 1:
            st["pooled_b"] = mean_pool(st.pop("h"), st.pop("mask_b"))
    if stage.head is not None:
        return stage.head(torch.cat([st["pooled_a"], st["pooled_b"], st["tab_h"]], dim=-1)).float()
    # float32 between stages whatever autocast produced: the stages' I/O shapes are declared.
    return tuple(st[k].float() if st[k].is_floating_point() else st[k] for k in carried(blocks[-1] + 1, n))


def stage_io(config: BertConfig, blocks: list[int], rows: int, seq_len: int, device) -> tuple[tuple, tuple]:
    """Example inputs and outputs of the stage holding ``blocks`` for a micro-batch of ``rows``.

    Declared, not inferred: torch.distributed.pipelining would infer them by running each stage
    on uninitialised tensors, and uninitialised token ids index outside the embedding.
    """
    n, h = config.num_hidden_layers, config.hidden_size
    shapes = {
        "ids_a": (rows, seq_len),
        "mask_a": (rows, seq_len),
        "ids_b": (rows, seq_len),
        "mask_b": (rows, seq_len),
        "tabular": (rows, config.num_tabular_features),
        "h": (rows, seq_len, h),
        "pooled_a": (rows, h),
        "tab_h": (rows, config.tabular_hidden_size),
    }

    def example(key: str, grad: bool = True) -> torch.Tensor:
        if key.startswith(("ids", "mask")):
            return torch.zeros(shapes[key], dtype=torch.int64, device=device)
        # Float activations from an earlier stage carry a gradient back; the batch's own do not.
        return torch.zeros(shapes[key], device=device, requires_grad=grad)

    inputs = tuple(example(k, grad=blocks[0] > 0) for k in carried(blocks[0], n))
    if blocks[-1] == 2 * n - 1:
        outputs = (torch.zeros((rows, config.num_classes), device=device),)
    else:
        outputs = tuple(example(k) for k in carried(blocks[-1] + 1, n))
    return inputs, outputs


def init_buffers(stage, config: BertConfig, device: torch.device) -> None:
    # position_ids / token_type_ids are non-persistent buffers: garbage after to_empty().
    for emb in (stage.embeddings_a, stage.embeddings_b):
        if emb is not None:
            positions = torch.arange(config.max_position_embeddings, device=device).expand((1, -1))
            emb.position_ids = positions
            emb.token_type_ids = torch.zeros_like(positions)


def initial_state(cfg, stage, shapes: dict) -> dict:
    state = full_init_state_dict(stage, cfg.train.seed, cfg.train.init_std, shapes)
    if cfg.model.pretrained.lower() == "none":
        return state
    names = {n: checkpoint_name(n, cfg.model.num_layers) for n in shapes}
    loaded = load_tensors(cfg.model.pretrained, sorted({c for c in names.values() if c}))
    for name, ckpt in names.items():
        if ckpt is not None:
            assert loaded[ckpt].shape == shapes[name], (name, loaded[ckpt].shape, shapes[name])
            state[name] = loaded[ckpt]
    return state


def tp_adjust(block, tp: int) -> None:
    attn = block.attention.self
    attn.num_attention_heads //= tp
    attn.all_head_size //= tp
