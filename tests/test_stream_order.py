"""The replica streams' exact output, pinned: a change to how a stream is built must not change
which token ids (or rows) step k trains on, nor the positions a checkpoint records.

Each kind of source (token windows, packed documents, labelled rows, chat examples padded and
packed) streams small synthetic data for three epochs with a shuffle buffer and two replicas.
The digests below were recorded from the three stream classes that each had their own copy of
this loop (before ReplicaStream took a source), so they hold the order as it was; the resume
checks hold for any order.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pytest

from raytrain_hybrid.data.local_rows import LocalRows
from raytrain_hybrid.data.sources import Examples, LabelledRows, TokenDocuments
from raytrain_hybrid.data.stream import ReplicaStream

SEQ, VOCAB = 8, 50
COMMON = {"global_batch": 4, "dp": 2, "seed": 5, "epochs": 3, "shuffle_buffer": 7}


def _documents() -> list[pa.Table]:
    """Two "files" of token-id documents of 1 to 29 tokens."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, VOCAB, rng.integers(1, 30)).tolist() for _ in range(41)]
    return [
        pa.table({"input_ids": pa.array(part, type=pa.list_(pa.int32())), "path": [name] * len(part)})
        for part, name in ((docs[:17], "a.parquet"), (docs[17:], "b.parquet"))
    ]


def _tokens(docs: list[list[int]]) -> pa.Table:
    return pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32())), "path": ["t.parquet"] * len(docs)})


def _examples() -> list[pa.Table]:
    """Encoded chat examples (input_ids, label_mask), some longer than the window."""
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, VOCAB, rng.integers(2, 14)).tolist() for _ in range(31)]
    masks = [[int(i > len(r) // 2) for i in range(len(r))] for r in ids]
    return [
        pa.table(
            {
                "input_ids": pa.array(ids[a:b], type=pa.list_(pa.int32())),
                "label_mask": pa.array(masks[a:b], type=pa.list_(pa.int8())),
                "path": ["e.parquet"] * (b - a),
            }
        )
        for a, b in ((0, 20), (20, 31))
    ]


def _labelled() -> list[dict]:
    """A classifier's encoded rows, as two "files" of numpy columns."""
    x = np.arange(27 * 3, dtype=np.float32).reshape(27, 3)
    label = np.arange(27, dtype=np.int64) % 3
    return [{"x": x[:10], "label": label[:10]}, {"x": x[10:], "label": label[10:]}]


def _stream(kind: str, dp_rank: int, skip_steps: int = 0, tables=None):
    args = {**COMMON, "dp_rank": dp_rank, "skip_steps": skip_steps}
    if kind in ("windows", "packed documents"):
        rows = LocalRows(lambda: iter(tables if tables is not None else _documents()))
        source = TokenDocuments(rows, "input_ids", SEQ, VOCAB, packing=kind == "packed documents")
    elif kind == "labelled rows":
        rows = LocalRows(lambda: iter(tables if tables is not None else _labelled()))
        source = LabelledRows(rows, num_classes=3)
    else:
        rows = LocalRows(lambda: iter(tables if tables is not None else _examples()))
        source = Examples(rows, SEQ, VOCAB, packing=kind == "packed examples")
    return ReplicaStream(source, **args)


def _steps(stream) -> list[tuple[dict, dict]]:
    """Each step's arrays (as a dict) and the position the stream stood at after it."""
    out = []
    for arrays in stream:
        arrays = arrays if isinstance(arrays, dict) else {"tokens": arrays}
        out.append((arrays, stream.position.manifest_entry()))
    return out


def _digest(steps: list[tuple[dict, dict]]) -> str:
    h = hashlib.sha256()
    for arrays, position in steps:
        for key in sorted(arrays):
            a = np.ascontiguousarray(arrays[key])
            h.update(f"{key}:{a.dtype}:{a.shape}".encode())
            h.update(a.tobytes())
        h.update(json.dumps(position, sort_keys=True).encode())
    return h.hexdigest()[:16]


# kind -> (steps over the three epochs, digest of replica 0's steps, of replica 1's)
RECORDED = {
    "windows": (48, "5e3baed8d132836f", "128e1f294cc3a208"),
    "packed documents": (54, "7d467639971e18cf", "7c210e278e7b6bb7"),
    "labelled rows": (18, "9d3d527a36aff0a4", "5c9216f59aa114d0"),
    "padded examples": (21, "f16ab659ae33c95c", "f51c41a184a53818"),
    "packed examples": (18, "495100b9bb6e03df", "9d558ff853c56211"),
}


@pytest.mark.parametrize("kind", list(RECORDED))
def test_each_stream_yields_the_recorded_batches_and_resumes_mid_epoch(kind):
    steps, *digests = RECORDED[kind]
    runs = [_steps(_stream(kind, r)) for r in range(2)]
    assert [len(run) for run in runs] == [steps, steps]
    assert {p["epoch"] for _, p in runs[0]} == {0, 1, 2}  # the steps cross two epoch boundaries
    assert [_digest(run) for run in runs] == digests
    # Both replicas stand at the same place after each step.
    assert [p for _, p in runs[0]] == [p for _, p in runs[1]]
    # A resume from a step in the middle of the second epoch skips to where the full run stood
    # and goes on with the same batches.
    skip = next(i for i, (_, p) in enumerate(runs[0]) if p["epoch"] == 1) + 1
    assert runs[0][skip - 1][1]["epoch"] == 1 and runs[0][skip][1]["epoch"] == 1
    resumed = _stream(kind, 0, skip_steps=skip)
    tail = _steps(resumed)
    assert resumed.position.skipped_to == runs[0][skip - 1][1]
    assert _digest(tail) == _digest(runs[0][skip:])


@pytest.mark.parametrize(
    ("kind", "tables", "message"),
    [
        ("windows", [], "the dataset is empty"),
        ("windows", lambda: [_tokens([[1, 2], [3]])], r"holds 3 tokens, fewer than one row of model.seq_len\+1=9"),
        ("packed documents", [], "the dataset is empty"),
        ("packed documents", lambda: [_documents()[0].slice(0, 1)], "holds 3 rows once packed, fewer than one global"),
        (
            "labelled rows",
            lambda: [{"x": np.zeros((3, 3), np.float32), "label": np.zeros(3, np.int64)}],
            "holds 3 rows, fewer",
        ),
        ("padded examples", lambda: [_examples()[0].slice(0, 3)], "holds 3 examples, fewer than one global batch"),
        ("packed examples", lambda: [_examples()[0].slice(0, 3)], "holds 3 rows once packed, fewer"),
    ],
)
def test_a_stream_that_cannot_fill_a_global_batch_says_so(kind, tables, message):
    tables = tables() if callable(tables) else tables
    with pytest.raises(ValueError, match=message):
        list(_stream(kind, 0, tables=tables))


def test_an_out_of_vocabulary_id_names_its_file():
    bad = pa.table({"input_ids": pa.array([[1, VOCAB]], type=pa.list_(pa.int32())), "path": ["bad.parquet"]})
    with pytest.raises(ValueError, match=r"token id 50 in column 'input_ids' of bad.parquet is outside \[0"):
        list(_stream("windows", 0, tables=[bad]))
    bad = bad.append_column("label_mask", pa.array([[0, 1]], type=pa.list_(pa.int8())))
    with pytest.raises(ValueError, match=r"token id 50 in bad.parquet is outside \[0, model.vocab_size=50\)"):
        list(_stream("padded examples", 0, tables=[bad]))


def test_epochs_that_make_no_global_batch_say_so():
    # 2 windows a pass, 1 pass: 2 rows, fewer than a global batch (the run trained 0 steps, said "completed")
    stream = _stream("windows", 0, tables=[_tokens([list(range(1, 19))])])
    stream.epochs = 1
    with pytest.raises(ValueError, match=r"makes 2 rows in data.epochs=1 passes, fewer than one global batch"):
        list(stream)
