"""Writes chat.parquet next to this file: 400 short conversations (a "messages" column of
[{role, content}] turns) for the fine-tuning example. The text is generated here from small
word lists (arithmetic, counting, opposites, reversed words), so the file is reproducible:

    .venv/bin/python examples/finetune_chat/make_data.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

OPPOSITES = [
    ("hot", "cold"),
    ("early", "late"),
    ("open", "closed"),
    ("light", "dark"),
    ("full", "empty"),
    ("fast", "slow"),
    ("high", "low"),
    ("wet", "dry"),
    ("near", "far"),
    ("loud", "quiet"),
]
WORDS = ["lamp", "river", "stone", "garden", "window", "letter", "bridge", "engine", "market", "harbor"]
SYSTEM = "You are a careful assistant. Answer in one short sentence."


def exchange(rng) -> tuple[str, str]:
    kind = int(rng.integers(4))
    if kind == 0:
        a, b = (int(x) for x in rng.integers(0, 50, size=2))
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        start = int(rng.integers(1, 20))
        stop = start + int(rng.integers(2, 6))
        return f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1)) + "."
    if kind == 2:
        word, other = OPPOSITES[int(rng.integers(len(OPPOSITES)))]
        return f"What is the opposite of '{word}'?", f"The opposite of '{word}' is '{other}'."
    word = WORDS[int(rng.integers(len(WORDS)))]
    return f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."


def conversations(count: int, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        msgs = [{"role": "system", "content": SYSTEM}] if i % 4 == 0 else []
        for _ in range(1 + int(rng.integers(3) == 0)):  # a third have a second exchange
            question, answer = exchange(rng)
            msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(msgs)
    return out


def main() -> None:
    kind = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    table = pa.table({"messages": pa.array(conversations(400), type=kind)})
    path = Path(__file__).resolve().parent / "chat.parquet"
    pq.write_table(table, path)
    print(f"wrote {path} ({table.num_rows} conversations)")


if __name__ == "__main__":
    main()
