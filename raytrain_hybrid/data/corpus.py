"""Training input: a packed token stream, batches fixed by (seed, step).

The corpus is tokenized once and packed into windows of ``seq_len + 1`` tokens
(documents joined with an end-of-text token, so short documents are packed, not
dropped). The order of windows is one permutation per epoch drawn from the seed;
the global batch of step k is the k-th slice of that order, and replica r of dp
takes the r-th contiguous share of it. Nothing here depends on tp or pp, so
every layout sees the same global batch, and every rank of one replica builds
exactly the same rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raytrain_hybrid.data.tokenizer import DEFAULT_CORPUS, EOT, load_tokenizer


@functools.lru_cache(maxsize=4)
def tokenize_corpus(corpus: str = "", tokenizer: str = "") -> np.ndarray:
    """All documents (blank-line separated) as one int32 token stream with EOT between them."""
    tok = load_tokenizer(tokenizer)
    path = Path(corpus or DEFAULT_CORPUS)
    docs = [d for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        if eot is not None:
            ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


# A label the loss does not count (a prompt or padding token): F.cross_entropy's default.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """One replica's share of a step: inputs for the first stage, labels for the last."""

    # LM: (token ids [rows, seq_len],), packed rows (data.packing) add (position ids [rows, seq_len]);
    # classifiers: rows.INPUTS
    inputs: tuple[torch.Tensor, ...]
    # LM: [rows, seq_len], the input shifted by one token (IGNORE_INDEX where not counted);
    # classifiers: [rows]
    labels: torch.Tensor

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs[0]

    @property
    def rows(self) -> int:
        return self.labels.shape[0]


class TokenWindows:
    """Deterministic global batches over a packed token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than model.seq_len+1={seq_len + 1}")

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def global_rows(self, step: int, global_batch: int) -> np.ndarray:
        """Window indices of the global batch of ``step`` (wrapping into later epochs)."""
        start = step * global_batch
        out = []
        while len(out) < global_batch:
            epoch, offset = divmod(start + len(out), self.num_windows)
            take = min(global_batch - len(out), self.num_windows - offset)
            out.extend(self._order(epoch)[offset : offset + take])
        return np.asarray(out)

    def steps_in(self, epochs: int, global_batch: int) -> int:
        """Global batches in ``epochs`` passes (a batch may span two passes' orders)."""
        return epochs * self.num_windows // global_batch

    def rows_to_batch(self, rows: np.ndarray) -> Batch:
        starts = rows * self.seq_len
        win = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        win = torch.from_numpy(win)
        return Batch(inputs=(win[:, :-1].contiguous(),), labels=win[:, 1:].contiguous())

    def replica_batch(self, step: int, global_batch: int, dp: int, dp_rank: int) -> Batch:
        rows = self.global_rows(step, global_batch)
        share = global_batch // dp
        return self.rows_to_batch(rows[dp_rank * share : (dp_rank + 1) * share])
