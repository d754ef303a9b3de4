"""The LoRA oracle's reference: peft on the unmodified transformers model, one process.

Nothing here comes from raytrain_hybrid: the model is ``AutoModelForCausalLM.from_pretrained``
of the checkpoint directory, the adapters are ``peft.get_peft_model``'s (``LoraConfig`` from
the run's [lora] keys), the loop is stock PyTorch (AdamW over the adapters peft marks
trainable, clip_grad_norm_, the learning-rate schedule and the corpus windows of
tests/reference.py, which shares no code with the engine either). Its one input from the
engine is the adapters' initial values (A is random), gathered to full tensors; the base
weights are transformers' own load.

``lora.dropout`` > 0: peft's ``nn.Dropout`` on each adapter's input is replaced by the rule the
engine documents (raytrain_hybrid/models/lora_dropout.py, written again here): an element is
kept by a hash of (seed, the linear's name, step, row of the global batch, position, feature),
so a single process and every layout drop the same elements.

Per step it returns the loss, the global gradient norm, the learning rate and every adapter's
gradient norm (where the engine's optimizer receives them: after clipping), under peft's
names without the ``base_model.model.`` prefix (the engine's names); after the last step every
parameter, adapters and frozen base alike (``reference[-1]["params"]``), and
``reference[0]["initial"]``, the state it started from.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from reference import _set_lr, memory_windows

PREFIX = "base_model.model."
M32, MUL = 0xFFFFFFFF, 0x45D9F3B


def _mix(x):
    x = (((x >> 16) ^ x) * MUL) & M32
    x = (((x >> 16) ^ x) * MUL) & M32
    return (x >> 16) ^ x


class PositionDropout(torch.nn.Module):
    """Dropout of a [rows, seq, features] input (the whole global batch), its mask the documented hash."""

    def __init__(self, p: float, name: str, seed: int, clock: dict) -> None:
        super().__init__()
        self.p, self.name, self.seed, self.clock = p, name, seed, clock

    def forward(self, x):
        if not self.training:
            return x
        key = zlib.crc32(f"{self.seed}:{self.name}:{self.clock['step']}".encode())
        b, s, h = x.shape
        index = torch.arange(b * s * h, dtype=torch.int64).reshape(b, s, h)
        keep = _mix((index & M32) ^ _mix((index >> 32) ^ key)) >= int(self.p * 2**32)
        return x * keep.to(x.dtype) / (1 - self.p)


def peft_model(cfg, pretrained: str):
    """The checkpoint's transformers model with peft's adapters for ``cfg.lora`` (fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(pretrained, local_files_only=True)
    for key, value in hf_config.to_dict().items():  # dropout off, as the engine has it (Seed-OSS's files say 0.1)
        if isinstance(value, float) and key.endswith(("dropout", "pdrop", "dropout_prob")):
            setattr(hf_config, key, 0.0)
    base = AutoModelForCausalLM.from_pretrained(
        pretrained, config=hf_config, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    lora = cfg.lora
    targets = "all-linear" if "all-linear" in lora.targets else list(lora.targets)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    model = get_peft_model(base, config)
    model.dropout_clock = {"step": 0}
    if lora.dropout:
        for name, module in model.named_modules():
            if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
                drop = PositionDropout(lora.dropout, name.removeprefix(PREFIX), cfg.train.seed, model.dropout_clock)
                module.lora_dropout["default"] = drop
    return model


def _named(model) -> dict[str, torch.Tensor]:
    return {n.removeprefix(PREFIX): p for n, p in model.named_parameters()}


def lora_reference_run(cfg, pretrained: str, initial: dict, steps: int | None = None) -> list[dict]:
    """Train peft's adapters on the in-memory corpus windows from the engine's initial adapters."""
    torch.manual_seed(0)
    model = peft_model(cfg, pretrained).train()  # (from_pretrained hands it over in eval mode: no dropout)
    named = _named(model)
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    with torch.no_grad():
        for n, p in trainable.items():
            p.copy_(torch.as_tensor(initial[n]))
    start = {n: p.detach().clone() for n, p in named.items()}
    t = cfg.train
    opt = torch.optim.AdamW(trainable.values(), lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=t.weight_decay)
    steps = t.steps if steps is None else steps
    windows = memory_windows(cfg, steps)
    out = []
    for step in range(steps):
        lr = _set_lr(opt, t, step)
        model.dropout_clock["step"] = step
        inputs, labels = windows[step][:, :-1], windows[step][:, 1:]
        loss = F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable.values(), t.grad_clip if t.grad_clip > 0 else math.inf)
        grad_norms = {n: p.grad.double().norm().item() for n, p in trainable.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({"step": step, "loss": loss.item(), "grad_norm": norm.item(), "lr": lr, "grad_norms": grad_norms})
    out[-1]["params"] = {n: p.detach().clone() for n, p in _named(model).items()}
    out[0]["initial"] = start
    out[-1]["model"] = model
    return out
