"""Turn a Hugging Face dataset into the chat rows fine-tuning reads (data.format = "chat"): a
Parquet file with one column, "messages", each row a conversation [{role, content}, ...] with
roles system / user / assistant. The chat template of the model's tokenizer renders it; the loss
counts the assistant turns.

    python examples/hf_dataset_to_chat.py SOURCE OUT.parquet [--split train] [--subset NAME] [--limit N]

SOURCE is a Hub dataset id (needs `pip install datasets`; HF_TOKEN for a gated one), or a local
.parquet, .jsonl or .json file (read with pyarrow, no `datasets` needed). The rows it understands:

- "messages": already chat rows (OpenAI style); kept, roles checked;
- "conversations" of {from, value} turns (ShareGPT: human / gpt / system);
- "instruction" with an optional "input" and an "output" (Alpaca);
- a prompt and an answer column: prompt / completion, prompt / response, question / answer.

Then point the config at it: `--set data.path=OUT.parquet --set data.format=chat`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
PAIRS = (("prompt", "completion"), ("prompt", "response"), ("question", "answer"))


def to_messages(row: dict) -> list[dict]:
    """One dataset row as a conversation; raises ValueError for a shape it does not know."""
    if row.get("messages") is not None:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    elif row.get("conversations") is not None:
        messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
    elif row.get("instruction") is not None and row.get("output") is not None:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    else:
        pair = next(((p, a) for p, a in PAIRS if row.get(p) is not None and row.get(a) is not None), None)
        if pair is None:
            raise ValueError(
                f"a row with columns {sorted(row)}: no messages, conversations, instruction/output or pair"
            )
        messages = [{"role": "user", "content": row[pair[0]]}, {"role": "assistant", "content": row[pair[1]]}]
    roles = {m["role"] for m in messages}
    if "assistant" not in roles or not roles <= {"system", "user", "assistant"}:
        raise ValueError(f"a conversation needs an assistant turn and roles system/user/assistant, got {roles}")
    return messages


def to_table(rows: Iterable[dict]) -> pa.Table:
    """The chat rows of ``rows`` (dicts, as a dataset or pyarrow yields them) as a table."""
    return pa.table({"messages": pa.array([to_messages(row) for row in rows], type=MESSAGES)})


def read_rows(source: str, split: str = "train", subset: str | None = None) -> Iterable[dict]:
    """The rows of a local Parquet / JSON Lines / JSON file, or of a Hub dataset's split."""
    path = Path(source)
    if path.suffix == ".parquet" or path.is_dir():
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        import pyarrow.json as pj

        if path.suffix == ".json" and path.read_text().lstrip().startswith("["):
            import json

            return json.loads(path.read_text())
        return pj.read_json(path).to_pylist()
    try:
        import datasets
    except ImportError:
        sys.exit(f"{source} is not a local file: reading a Hub dataset needs `pip install datasets`")
    return datasets.load_dataset(source, subset, split=split)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a Hub dataset id, or a local .parquet / .jsonl / .json file")
    parser.add_argument("out", type=Path, help="the Parquet file to write")
    parser.add_argument("--split", default="train", help="the dataset's split (Hub datasets)")
    parser.add_argument("--subset", default=None, help="the dataset's configuration name (Hub datasets)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many rows (0: all)")
    args = parser.parse_args(argv)
    rows = read_rows(args.source, args.split, args.subset)
    if args.limit:
        rows = [row for _, row in zip(range(args.limit), rows, strict=False)]
    table = to_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.out)
    print(f"wrote {args.out} ({table.num_rows} conversations)")


if __name__ == "__main__":
    main()
