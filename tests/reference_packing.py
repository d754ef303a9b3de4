"""The single-process reference for packed data (data.packing): every example run alone.

Nothing here comes from raytrain_hybrid's data, model or loss code. The examples are read and
tokenized by tests/reference_chat.py (chat) or tests/reference.py (the shipped corpus's documents,
split at EOT, a long one cut into pieces of seq_len+1 tokens overlapping by one); they go through
the same shuffle buffer (written again in those files), then into rows by first fit (written again
below: each example into the first of 16 open rows with room; with none, the fullest row closes).
Which rows a step trains on fixes which examples it counts, nothing more: each example runs
alone through an unmodified transformers model (eager attention, positions 0..n-1, no mask), and
the step's loss is the sum of the cross-entropies of the counted tokens of all its examples over
their count, what a packed row must give whatever shares it. AdamW, clipping and the LR schedule
are tests/reference.py's.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

OPEN = 16  # rows open at once


def first_fit(examples: list, width: int) -> list[list]:
    """Examples (ids, mask) -> rows, each the list of its examples, in the order rows close."""
    open_rows: list[list] = []
    closed = []
    for ex in examples:
        size = len(ex[0])
        fits = [r for r in open_rows if sum(len(e[0]) for e in r) + size <= width]
        if fits:
            fits[0].append(ex)
            continue
        if len(open_rows) == OPEN:
            used = [sum(len(e[0]) for e in r) for r in open_rows]
            closed.append(open_rows.pop(used.index(max(used))))
        open_rows.append([ex])
    return closed + open_rows


def text_examples(tokens: np.ndarray, eot: int, width: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The corpus stream as documents (each through its EOT); a document longer than ``width`` in
    pieces of ``width`` tokens starting every width-1 tokens; every token a label but a piece's first."""
    out = []
    start = 0
    for end in [*np.flatnonzero(tokens == eot) + 1, len(tokens)]:
        doc = tokens[start:end]
        start = end
        at = 0
        while doc.size and at < max(len(doc) - 1, 1):
            piece = doc[at : at + width]
            out.append((piece, np.r_[0, np.ones(len(piece) - 1, dtype=np.int64)]))
            at += width - 1
    return out


def packed_steps(cfg, examples: list, shuffle) -> list[list]:
    """Per step, the examples of its global batch: per epoch, the examples through the shuffle
    buffer (``shuffle(items, size, seed)``), packed; the epoch's rows that fill no batch dropped."""
    gb, width, d = cfg.train.global_batch_size, cfg.model.seq_len + 1, cfg.data
    out, epoch = [], 0
    while len(out) < cfg.train.steps:
        rows = first_fit(shuffle(examples, d.shuffle_buffer, d.shuffle_seed + epoch), width)
        out += [[ex for row in rows[k * gb : (k + 1) * gb] for ex in row] for k in range(len(rows) // gb)]
        epoch += 1
    return out[: cfg.train.steps]


def summed_loss(model, examples: list) -> tuple[torch.Tensor, int]:
    """Sum of the counted tokens' cross-entropies, each example in a forward of its own; their count."""
    total, count = torch.zeros(()), 0
    for ids, mask in examples:
        ids, counted = torch.as_tensor(ids)[None], torch.as_tensor(mask[1:]).bool()
        logits = model(input_ids=ids[:, :-1]).logits[0]
        ce = F.cross_entropy(logits, ids[0, 1:], reduction="none")
        total = total + ce[counted].sum()
        count += int(counted.sum())
    return total, count


@contextlib.contextmanager
def one_thread():
    """Many small forwards: one thread is several times faster on a busy machine (two threads
    spin waiting for each other, as the suite's other processes hold the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def packed_reference_run(cfg, steps: list, initial: dict) -> list[dict]:
    """tests/reference.py's loop, the loss of step k: summed_loss over steps[k] / its count."""
    with one_thread():
        return _packed_reference_run(cfg, steps, initial)


def _packed_reference_run(cfg, steps: list, initial: dict) -> list[dict]:
    from reference import _train, gpt2_from_engine, gpt2_to_engine, lm_model

    torch.manual_seed(0)
    gpt2 = cfg.model.arch == "gpt2"
    start = {n: torch.as_tensor(v) for n, v in initial.items()}
    model = lm_model(cfg)
    model.load_state_dict(gpt2_from_engine(start) if gpt2 else start, strict=True)

    def loss_of(model, step):
        total, count = summed_loss(model, steps[step])
        return total / count

    out = _train(cfg, model, gpt2_to_engine if gpt2 else dict, loss_of)
    out[0]["initial"] = start
    return out
