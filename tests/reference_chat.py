"""The single-process reference for chat data: what a plain loop trains on masked examples.

Nothing here comes from raytrain_hybrid's data or loss code. Each conversation is rendered with
the tokenizer's chat template through transformers' own apply_chat_template, and its assistant
turns are found by token counts (the conversation rendered and tokenized up to the turn with
the generation prompt, then through the turn: the tokens in between count), not the package's
character offsets. Each example is cut to seq_len+1 tokens (dropped if no counted label is
left), padded with mask 0; the global batch of step k is the k-th run of B examples of the
file's order through a shuffle buffer (written again here). The loss is the plain masked mean
over the whole global batch in one forward. The model, AdamW, clipping and the LR schedule are
tests/reference.py's.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F


def _ids(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"])


@functools.lru_cache(maxsize=4)
def chat_examples(tokenizer_dir, path, seq_len: int, column: str = "messages") -> list[tuple[np.ndarray, np.ndarray]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for row in pq.read_table(str(path)).to_pylist():
        msgs = row[column]
        ids = _ids(tok, msgs)
        mask = np.zeros(len(ids), dtype=np.int64)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                start = len(_ids(tok, msgs[:i], add_generation_prompt=True)) if i else 0
                mask[start : len(_ids(tok, msgs[: i + 1]))] = 1
        ids, mask = np.asarray(ids[: seq_len + 1]), mask[: seq_len + 1]
        if mask[1:].any():
            out.append((ids, mask))
    return out


def prompt_completion_examples(tokenizer_dir, path, seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """TRL's way: the prompt tokenized alone gives its length; prompt + completion tokenized
    together, the tokens after the prompt's and an appended EOS are counted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for row in pq.read_table(str(path)).to_pylist():
        prompt = tok(row["prompt"])["input_ids"]
        ids = tok(row["prompt"] + row["completion"])["input_ids"] + [tok.eos_token_id]
        mask = np.asarray([0] * len(prompt) + [1] * (len(ids) - len(prompt)))
        out.append((np.asarray(ids[: seq_len + 1]), mask[: seq_len + 1]))
    return out


def _buffer_shuffle(items: list, size: int, seed: int) -> list:
    """A shuffle buffer of ``size``: when full, each new item replaces a random one, which goes
    out; what is left goes out last, permuted."""
    if size <= 0:
        return list(items)
    rng = np.random.default_rng(seed)
    buf, out = list(items[:size]), []
    for item in items[size:]:
        j = int(rng.integers(size))
        out.append(buf[j])
        buf[j] = item
    return out + [buf[j] for j in rng.permutation(len(buf))]


def batches(cfg, examples, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step (tokens [B, seq_len+1], mask [B, seq_len+1]); an epoch's tail that does not fill a
    batch is not used, the next epoch goes through the buffer with seed + 1."""
    gb, width, d = cfg.train.global_batch_size, cfg.model.seq_len + 1, cfg.data
    out, epoch = [], 0
    while len(out) < cfg.train.steps:
        order = _buffer_shuffle(examples, d.shuffle_buffer, d.shuffle_seed + epoch)
        for k in range(len(order) // gb):
            rows = order[k * gb : (k + 1) * gb]
            tokens = torch.full((gb, width), pad, dtype=torch.int64)
            mask = torch.zeros((gb, width), dtype=torch.int64)
            for r, (ids, m) in enumerate(rows):
                tokens[r, : len(ids)], mask[r, : len(m)] = torch.as_tensor(ids), torch.as_tensor(m)
            out.append((tokens, mask))
        epoch += 1
    return out[: cfg.train.steps]


def masked_mean(model, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next token, averaged over the counted labels of these rows."""
    logits = model(input_ids=tokens[:, :-1]).logits
    ce = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    counted = mask[:, 1:].flatten().float()
    return (ce * counted).sum() / counted.sum()


def masked_reference_run(cfg, steps: list, initial=None, model=None) -> list[dict]:
    """tests/reference.py's loop with the masked mean as its loss; ``model``: a transformers model
    already holding ``initial`` (one loaded with from_pretrained), else reference.py's for cfg."""
    from reference import _engine_initial, _train, gpt2_from_engine, gpt2_to_engine, lm_model

    torch.manual_seed(0)
    gpt2 = cfg.model.arch == "gpt2"
    start = _engine_initial(cfg, initial)
    if model is None:
        model = lm_model(cfg)
        model.load_state_dict(gpt2_from_engine(start) if gpt2 else start, strict=True)
    out = _train(cfg, model, gpt2_to_engine if gpt2 else dict, lambda model, step: masked_mean(model, *steps[step]))
    out[0]["initial"] = start
    return out


def mean_of_split_means(cfg, tokens, mask, dp: int, microbatches: int, initial) -> tuple[float, float]:
    """What a loss normalized per micro-batch would give at step 0: the mean over replicas and
    micro-batches of each one's own masked mean (the split the layouts make), and the norm of
    its gradient."""
    from reference import gpt2_from_engine, lm_model

    model = lm_model(cfg)
    state = {n: torch.as_tensor(v) for n, v in initial.items()}
    model.load_state_dict(gpt2_from_engine(state) if cfg.model.arch == "gpt2" else state, strict=True)
    parts = dp * microbatches
    means = [masked_mean(model, t, m) for t, m in zip(tokens.chunk(parts), mask.chunk(parts), strict=True)]
    loss = torch.stack(means).mean()
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    return float(loss.detach()), float(norm)
