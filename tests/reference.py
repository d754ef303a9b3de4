"""The oracle: an independent plain-PyTorch loop over the unmodified transformers model.

It shares only the initial weights (through the architecture's ``to_hf``
conversion) and the data rows with the project; the forward pass, the loss,
the clipping, the optimizer and the learning-rate schedule are written here
again, by hand or with stock PyTorch, so that a bug cannot hide in both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.corpus import TokenWindows, tokenize_corpus
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.common import build_stage, full_init_state_dict


def initial_hf_state_dict(cfg: Config) -> dict:
    spec = get_arch(cfg.model.arch)
    hf_config = spec.hf_config(cfg)
    meta = build_stage(spec, hf_config, list(range(cfg.model.num_layers)), first=True, last=True)
    shapes = {name: p.shape for name, p in meta.named_parameters()}
    return spec.to_hf(full_init_state_dict(meta, cfg.train.seed, cfg.train.init_std, shapes))


def ray_data_batches(cfg: Config, steps: int) -> list:
    """The global batches of the Ray Data input, read in this process as one replica (dp=1)."""
    from raytrain_hybrid.data.ray_data import build_dataset, ordered_iterator
    from raytrain_hybrid.data.stream import replica_stream
    from raytrain_hybrid.launch.inputs import prepare_input

    cfg = prepare_input(cfg)
    stream = replica_stream(cfg, ordered_iterator(build_dataset(cfg)), dp=1, dp_rank=0)
    out = []
    for rows in stream:
        out.append(torch.from_numpy(rows))
        if len(out) == steps:
            break
    return out


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


def _update(model, opt, loss, t) -> float:
    """Backward, clip the global norm with stock PyTorch, AdamW step; returns the norm."""
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm.item()


def ray_data_rows(cfg: Config, steps: int) -> list[dict]:
    """Classifiers: the global batches of labelled rows the launcher's Ray Data input gives."""
    from raytrain_hybrid.data.ray_data import build_dataset, ordered_iterator
    from raytrain_hybrid.data.stream import replica_stream
    from raytrain_hybrid.launch.inputs import prepare_input

    cfg = prepare_input(cfg)
    out = []
    for rows in replica_stream(cfg, ordered_iterator(build_dataset(cfg)), dp=1, dp_rank=0):
        out.append(rows)
        if len(out) == steps:
            break
    return out


def reference_run(cfg: Config, windows: list | None = None, keep_model: list | None = None) -> list[dict]:
    """``windows``: per step, the global batch as [B, seq_len+1] token ids; default: the
    in-memory corpus windows the engine uses without Ray. ``keep_model``: a list that receives
    the trained transformers model."""
    spec = get_arch(cfg.model.arch)
    hf_config = spec.hf_config(cfg)
    model_cls = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[cfg.model.arch]
    import transformers

    model = getattr(transformers, model_cls)(hf_config)
    missing, unexpected = model.load_state_dict(initial_hf_state_dict(cfg), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay)
    data = TokenWindows(tokenize_corpus(tokenizer=cfg.data.tokenizer), cfg.model.seq_len, t.seed)
    out = []
    for step in range(t.steps):
        lr = _set_lr(opt, t, step)
        if windows is None:
            win = data.rows_to_batch(data.global_rows(step, t.global_batch_size))
            inputs, labels = win.input_ids, win.labels
        else:
            inputs, labels = windows[step][:, :-1], windows[step][:, 1:]
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        out.append({"step": step, "loss": loss.item(), "grad_norm": _update(model, opt, loss, t), "lr": lr})
    if keep_model is not None:
        keep_model.append(model)
    return out


def classifier_reference_run(cfg: Config, batches: list | None = None, val_rows: dict | None = None) -> list[dict]:
    """The multimodal classifier as one plain module (MultimodalBert.forward, no stages), on
    the in-memory rows (or ``batches``: per step, the global batch as a dict of arrays).
    With ``val_rows``, the last step's entry also holds the trained model's validation
    logits and labels ("val_logits", "val_labels")."""
    from raytrain_hybrid.data.rows import BUILTIN_TRAIN, INPUTS, RowBatches, read_parquet_rows
    from raytrain_hybrid.models.multimodal_bert import MultimodalBert

    spec = get_arch(cfg.model.arch)
    hf_config = spec.hf_config(cfg)
    model = MultimodalBert(hf_config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    model.load_state_dict(spec.initial_state(cfg, model, shapes), strict=False)
    t = cfg.train
    weights = torch.tensor(cfg.model.class_weights or [1.0] * cfg.model.num_classes)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay)
    data = RowBatches(read_parquet_rows(BUILTIN_TRAIN, cfg), t.seed) if batches is None else None
    out = []
    for step in range(t.steps):
        lr = _set_lr(opt, t, step)
        rows = data.take(data.global_rows(step, t.global_batch_size)) if batches is None else batches[step]
        x = [torch.as_tensor(rows[k]) for k in INPUTS]
        y = torch.as_tensor(rows["label"])
        logits = model(*x)
        loss = (weights[y] * F.cross_entropy(logits, y, reduction="none")).sum() / len(y)
        out.append({"step": step, "loss": loss.item(), "grad_norm": _update(model, opt, loss, t), "lr": lr})
    if val_rows is not None:
        with torch.no_grad():
            out[-1]["val_logits"] = model(*[torch.as_tensor(val_rows[k]) for k in INPUTS])
        out[-1]["val_labels"] = torch.as_tensor(val_rows["label"])
    return out
