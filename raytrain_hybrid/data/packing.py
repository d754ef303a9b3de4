"""Packing (``data.packing``): whole examples share a row of ``seq_len + 1`` tokens.

Each example (a chat or prompt/completion row, or a raw-text document) keeps its own tokens,
its label mask and its own position ids, which restart at 0 where it begins. The rows go to the
model as two inputs: the token ids and the position ids. The model derives from the position
ids where each example begins, confines attention to it (block-diagonal causal mask) and
rotates (RoPE) or looks up (GPT-2) positions from them, so an example attends and is encoded
exactly as if it were alone. The label of an example's last token would be the next example's
first token: an example's first token is never counted (its mask is 0), so no loss crosses a
boundary.

How rows fill (first fit, TRL's and axolotl's kind of bin packing, in stream order): each example
goes into the first of ``OPEN_ROWS`` open rows with room for it; when none has room, the fullest
open row is closed (handed on) and a new one opened. At the end of an epoch the open rows are
closed in the order they were opened. The rows depend on the examples' order alone, so every
layout trains on the same global batches. The end of a row no example fills is padding (id 0,
mask 0, positions counting from 0 as one more example that no counted label ever sees).

An example is at most ``seq_len + 1`` tokens: chat and prompt/completion rows are cut to it
before (data.chat, counted by the input check); a raw-text document longer than that is split
into pieces of ``seq_len + 1`` tokens that overlap by one (as unpacked windows do), so each of
its tokens but the first is a label exactly once; each piece is an example of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

# Rows filled at once. More open rows fill gaps better (less padding) and keep examples
# longer out of order; 16 leaves about 1 % padding on the shipped chat set at seq_len 1024.
OPEN_ROWS = 16

Row = tuple[np.ndarray, np.ndarray, np.ndarray]  # (tokens, label mask, position ids), each [width]


def _close(parts: list[tuple[np.ndarray, np.ndarray]], width: int) -> Row:
    tokens, mask, positions = (np.zeros(width, dtype=np.int64) for _ in range(3))
    at = 0
    for ids, m in parts:
        tokens[at : at + ids.size], mask[at : at + ids.size] = ids, m
        positions[at : at + ids.size] = np.arange(ids.size)
        at += ids.size
    positions[at:] = np.arange(width - at)  # padding: one more example, never counted
    return tokens, mask, positions


def first_fit(items: Iterable, size, width: int, open_rows: int = OPEN_ROWS) -> Iterator[list]:
    """``items`` (each ``size(item)`` tokens, at most ``width``) -> the rows as lists of items, in
    the order they close (see the module)."""
    rows: list[list] = []
    used: list[int] = []
    for item in items:
        n = size(item)
        assert 0 < n <= width, (n, width)
        at = next((i for i, u in enumerate(used) if u + n <= width), None)
        if at is None:
            if len(rows) == open_rows:
                fullest = used.index(max(used))  # the first of equals
                used.pop(fullest)
                yield rows.pop(fullest)
            rows.append([])
            used.append(0)
            at = len(rows) - 1
        rows[at].append(item)
        used[at] += n
    yield from rows


def pack(examples: Iterable[tuple[np.ndarray, np.ndarray]], width: int, open_rows: int = OPEN_ROWS) -> Iterator[Row]:
    """(ids, mask) examples of at most ``width`` tokens -> rows of ``width`` (see the module)."""
    for parts in first_fit(examples, lambda e: e[0].size, width, open_rows):
        yield _close(parts, width)


def packed_rows(lengths: Iterable[int], width: int) -> int:
    """How many rows examples of these lengths fill, in this order (the input check)."""
    return sum(1 for _ in first_fit(lengths, int, width))


def document_pieces(ids: np.ndarray, width: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A raw-text document as examples of at most ``width`` tokens, each with its mask (every
    token a label but its first); pieces overlap by one token, so none is lost as a label."""
    if ids.size == 0:
        return
    step = width - 1
    for start in range(0, max(ids.size - 1, 1), step):
        piece = ids[start : start + width]
        mask = np.ones(piece.size, dtype=np.int64)
        mask[0] = 0
        yield piece, mask


def rows_arrays(rows: list[Row], packed: bool) -> dict[str, np.ndarray]:
    """Rows -> what a replica's leader broadcasts: tokens and label_mask (and positions when packed)."""
    out = {"tokens": np.stack([r[0] for r in rows]), "label_mask": np.stack([r[1] for r in rows])}
    if packed:
        out["positions"] = np.stack([r[2] for r in rows])
    return out


def corpus_documents(tokens: np.ndarray, eot: int | None) -> list[np.ndarray]:
    """The shipped corpus's token stream (data.corpus) as its documents, each ending in EOT."""
    if eot is None:
        return [tokens]
    ends = np.flatnonzero(tokens == eot) + 1
    return [d for d in np.split(tokens, ends) if d.size]
