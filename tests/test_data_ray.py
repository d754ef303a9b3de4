"""Ray Data input: DP-axis sharding, determinism, packing and bad data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_hybrid.config import load_config
from raytrain_hybrid.errors import ConfigError

SEQ = 16


def _write(path: Path, table: pa.Table, files: int = 3) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    per = -(-table.num_rows // files)
    for i in range(files):
        pq.write_table(table.slice(i * per, per), path / f"part-{i}.parquet")
    return path


def _row_id_dataset(path: Path, rows: int) -> Path:
    """Each document is exactly one window whose first token is its row id."""
    rng = np.random.default_rng(0)
    ids = [[r] + rng.integers(100, 4000, SEQ).tolist() for r in range(rows)]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32())), "row_id": list(range(rows))})
    return _write(path, table)


def _cfg(path, *extra):
    return load_config(
        None,
        [
            f"data.path={path}",
            f"model.seq_len={SEQ}",
            "parallelism.dp=1",
            "parallelism.tp=1",
            "parallelism.pp=1",
            "parallelism.microbatches=1",
            "train.global_batch_size=8",
            *extra,
        ],
    )


def _stream(cfg, dp, dp_rank):
    from raytrain_hybrid.data.ray_data import build_dataset, ordered_iterator
    from raytrain_hybrid.data.stream import replica_stream

    return replica_stream(cfg, ordered_iterator(build_dataset(cfg)), dp=dp, dp_rank=dp_rank)


def test_replicas_cover_an_epoch_once_and_agree_with_dp1(ray_local, tmp_path):
    path = _row_id_dataset(tmp_path / "ds", rows=64)
    cfg = _cfg(path, "data.epochs=1", "data.shuffle_seed=3")
    shares = {r: [b for b in _stream(cfg, 2, r)] for r in range(2)}
    seen = [int(w[0]) for r in range(2) for b in shares[r] for w in b]
    assert sorted(seen) == list(range(64))  # every row once across replicas
    whole = list(_stream(cfg, 1, 0))
    assert len(whole) == len(shares[0]) == 8
    for step, batch in enumerate(whole):  # global batch k is the same at dp=1 and dp=2
        np.testing.assert_array_equal(batch, np.concatenate([shares[0][step], shares[1][step]]))
    again = list(_stream(cfg, 1, 0))
    assert all((a == b).all() for a, b in zip(whole, again, strict=True))  # deterministic
    assert [int(w[0]) for w in whole[0]] != list(range(8))  # and shuffled


class _Blocks:
    """A stand-in for Ray Data's iterator that hands out the same rows cut into given blocks
    (how Ray cuts a read depends on the CPUs of the placement group reading it)."""

    def __init__(self, table: pa.Table, sizes: list[int]):
        self.table, self.sizes = table, sizes

    def iter_batches(self, batch_size, batch_format, **kwargs):
        assert not kwargs, "no Ray Data shuffle: its order depends on the blocks"
        start = 0
        for size in self.sizes:
            block = self.table.slice(start, size)
            start += size
            yield block if batch_format == "pyarrow" else {k: np.asarray(v) for k, v in block.to_pydict().items()}


def test_the_shuffle_does_not_depend_on_how_the_read_is_cut_into_blocks():
    """Ray Data's own local shuffle gives another order when the same rows come in other
    blocks, so a layout with another worker count would train on other documents; the
    stream's shuffle depends on the rows' order and the seed only (and still shuffles)."""
    from raytrain_hybrid.data.sources import LabelledRows, TokenDocuments
    from raytrain_hybrid.data.stream import ReplicaStream

    rows = 600
    rng = np.random.default_rng(1)
    ids = [[r] + rng.integers(100, 4000, SEQ).tolist() for r in range(rows)]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int32()))})
    cuts = ([rows], [300, 300], [37] * 16 + [8], [1] * 50 + [550])
    common = {"global_batch": 8, "dp": 2, "seed": 4, "epochs": 2, "shuffle_buffer": 256}

    def windows(sizes, dp_rank):
        stream = ReplicaStream(TokenDocuments(_Blocks(table, sizes), "input_ids", SEQ, 4096), dp_rank=dp_rank, **common)
        return np.concatenate(list(stream))

    first = {r: windows(cuts[0], r) for r in range(2)}
    for sizes in cuts[1:]:
        for r in range(2):
            np.testing.assert_array_equal(windows(sizes, r), first[r])
    order = [int(w[0]) for w in first[0][: 4 * 10]]
    assert order != sorted(order)  # shuffled
    epochs = np.concatenate([first[0], first[1]])
    assert sorted(int(w[0]) for w in epochs) == sorted(list(range(rows)) * 2)  # each row once per epoch

    labelled = pa.table({"x": np.arange(rows, dtype=np.float32), "label": np.arange(rows) % 2})

    def labelled_rows(sizes):
        stream = ReplicaStream(LabelledRows(_Blocks(labelled, sizes), num_classes=2), dp_rank=0, **common)
        return np.concatenate([b["x"] for b in stream])

    want = labelled_rows(cuts[0])
    assert list(want[:20]) != sorted(want[:20])
    for sizes in cuts[1:]:
        np.testing.assert_array_equal(labelled_rows(sizes), want)


def test_data_epochs_end_the_in_memory_data_as_they_end_the_streams():
    """data.path=memory (the shipped corpus or rows, no Ray): data.epochs passes end the data
    where the reference's derivation of the same windows and rows ends it (the corpus's 5,533
    windows of 32 tokens: 10 global batches of 1,024 in two passes, one spanning both; 2,000
    rows: 3 batches of 512 in one pass); a classifier's count is known before the run."""
    from types import SimpleNamespace

    import torch
    from reference import memory_row_batches, memory_windows

    from raytrain_hybrid.data.rows import BUILTIN_TRAIN, read_parquet_rows
    from raytrain_hybrid.engine.worker import in_memory_batches
    from raytrain_hybrid.launch.plan.inputs import steps_to_train

    common = ("data.path=memory", "train.steps=100", "parallelism.dp=2", "parallelism.tp=1", "parallelism.pp=1")
    lm = load_config(None, [*common, "model.seq_len=32", "train.global_batch_size=1024", "data.epochs=2"])
    rows = load_config(None, [*common, "model.arch=multimodal-bert", "model.pretrained=none",
                              "train.global_batch_size=512", "data.epochs=1"])  # fmt: skip
    for cfg, task, want in ((lm, "lm", memory_windows(lm, 100)), (rows, "classify", None)):
        if want is None:
            want = memory_row_batches(rows, read_parquet_rows(BUILTIN_TRAIN, rows), 100)
        trainers = [
            SimpleNamespace(spec=SimpleNamespace(task=task), dims=SimpleNamespace(dp=2), dp_rank=r) for r in (0, 1)
        ]
        replicas, ends = zip(*(in_memory_batches(cfg, trainer) for trainer in trainers), strict=True)
        assert len(want) == (10 if task == "lm" else 3) and set(ends) == {len(want)}  # known up front
        last = len(want) - 1
        assert all(next_batch(len(want)) is None for next_batch in replicas)
        got = [next_batch(last) for next_batch in replicas]
        labels = torch.cat([b.labels for b in got])
        if task == "lm":  # the last batch, from the second pass's order
            torch.testing.assert_close(labels, want[last][:, 1:])
        else:
            torch.testing.assert_close(labels, torch.as_tensor(want[last]["label"]))
    assert steps_to_train(rows) == 3 and steps_to_train(lm) == 100  # an LM's windows: as they are read


def test_short_documents_are_packed(ray_local, tmp_path):
    docs = [[7] * 5 for _ in range(40)]  # 200 tokens, each document shorter than a window
    path = _write(tmp_path / "short", pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))}), files=1)
    cfg = _cfg(path, "data.epochs=1", "train.global_batch_size=2")
    batches = list(_stream(cfg, 1, 0))
    windows = 200 // (SEQ + 1)
    assert sum(len(b) for b in batches) == windows - windows % 2
    assert all(b.shape[1] == SEQ + 1 for b in batches)


def test_text_column_is_tokenized_with_ray_data(ray_local, tmp_path):
    text = (Path(__file__).resolve().parents[1] / "raytrain_hybrid/assets/corpus.txt").read_text().split("\n\n")[:50]
    path = _write(tmp_path / "text", pa.table({"body": text}), files=2)
    cfg = _cfg(path, "data.text_column=body", "data.epochs=1")
    from raytrain_hybrid.data.checks import schema_check

    assert schema_check(cfg) == 50  # data.token_column keeps its default and must not get in the way
    batches = list(_stream(cfg, 1, 0))
    assert batches and batches[0].shape == (8, SEQ + 1)
    assert batches[0].max() < 4096


def test_token_id_outside_vocab_names_file_and_column(ray_local, tmp_path):
    path = _write(
        tmp_path / "big", pa.table({"input_ids": pa.array([[1, 2, 5000] * 10], type=pa.list_(pa.int32()))}), files=1
    )
    cfg = _cfg(path)
    with pytest.raises(ValueError, match=r"token id 5000 in column 'input_ids' of .*part-0.parquet"):
        next(iter(_stream(cfg, 1, 0)))


def test_footer_readers_scale_with_the_files(tmp_path, monkeypatch):
    """The launcher's Parquet footer readers: 1 per 64 files, a user's own setting wins (checked
    here: the suite sets one for all its reads, conftest.py)."""
    from raytrain_hybrid.launch.plan.inputs import reader_env

    key = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
    table = pa.table({"input_ids": pa.array([[1, 2]], type=pa.list_(pa.int32()))})
    many = _write(tmp_path / "many", table, files=65)
    monkeypatch.delenv(key, raising=False)
    assert reader_env(_cfg(many)) == {key: "2"}
    assert reader_env(_cfg(_write(tmp_path / "one", table, files=1))) == {key: "1"}
    assert reader_env(_cfg("memory")) == {}
    monkeypatch.setenv(key, "7")
    assert reader_env(_cfg(many)) == {key: "7"}


@pytest.mark.parametrize(
    "case",
    ["missing-column", "empty", "non-text", "non-token", "corrupt", "no-files", "tokenizer-vocab", "no-tokenizer"],
)
def test_bad_data_is_refused_before_workers(tmp_path, case):
    from raytrain_hybrid.data.checks import schema_check

    d = tmp_path / case
    extra: list[str] = []
    if case == "missing-column":
        _write(d, pa.table({"tokens": pa.array([[1, 2]], type=pa.list_(pa.int32()))}), files=1)
        key = "data.token_column"
    elif case == "empty":
        _write(d, pa.table({"input_ids": pa.array([], type=pa.list_(pa.int32()))}), files=1)
        key = "data.path"
    elif case == "non-text":
        _write(d, pa.table({"body": [1, 2, 3]}), files=1)
        extra, key = ["data.text_column=body"], "data.text_column"
    elif case == "non-token":
        _write(d, pa.table({"input_ids": ["a", "b"]}), files=1)
        key = "data.token_column"
    elif case in ("tokenizer-vocab", "no-tokenizer"):
        # Text with a tokenizer the model cannot take: the shipped BPE has 4096 tokens.
        _write(d, pa.table({"body": ["some text here"] * 4}), files=1)
        extra = ["data.text_column=body"]
        extra += ["model.vocab_size=1024"] if case == "tokenizer-vocab" else [f"data.tokenizer={tmp_path}/nope.json"]
        key = "data.tokenizer"
    elif case == "corrupt":
        _write(d, pa.table({"input_ids": pa.array([[1, 2]], type=pa.list_(pa.int32()))}), files=1)
        (d / "part-9.parquet").write_bytes(b"PAR1 this is not parquet")
        key = "data.path"
    else:
        d.mkdir()
        key = "data.path"
    with pytest.raises(ConfigError) as info:
        schema_check(_cfg(d, *extra))
    assert info.value.key == key, info.value
