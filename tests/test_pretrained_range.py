"""model.pretrained on object storage is read by byte range, not downloaded.

A tiny Llama checkpoint (transformers' save_pretrained: three safetensors files and an index)
is uploaded to the loopback S3 server. Two gloo ranks at tp=2 build the engine's Trainer from
the bucket and from the local directory: each rank's shards from S3 equal its shards from the
local directory and the slices of the safetensors tensors (read by safetensors itself), each
rank fetches about half the weights' bytes (its TP half plus the headers: less than 0.6 of the
files), and nothing is written under the node's temp directory (no copy is staged).
"""

from __future__ import annotations

import os

import numpy as np


def _load_both(rank: int, world: int, local: str, uri: str, tmp: str) -> dict:
    """One gloo rank: the Trainer from each source; its local shards and the bytes fetched."""
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from raytrain_hybrid.config import load_config
    from raytrain_hybrid.distributed.parallel_dims import ParallelDims, arrange_ranks
    from raytrain_hybrid.engine import trainer as trainer_mod

    os.environ["TMPDIR"], tempfile.tempdir = tmp, None  # this node's temp directory, watched by the test
    readers = []
    inner = trainer_mod.load_hf_weights
    trainer_mod.load_hf_weights = lambda *a, **k: readers.append(inner(*a, **k))  # this process only
    out = {}
    for name, where in (("local", local), ("s3", uri)):
        cfg = load_config(
            None, [f"model.pretrained={where}", "parallelism.tp=2", "parallelism.dp=1", "parallelism.pp=1"]
        )
        dims = ParallelDims.from_config(cfg.parallelism)
        trainer = trainer_mod.Trainer(
            cfg, dims, dims.build_mesh("cpu", arrange_ranks(dims, ["n"] * world)), torch.device("cpu")
        )
        shards = {}
        for n, p in trainer.modules[0].named_parameters():
            local_part = p.to_local() if isinstance(p, DTensor) else p
            offsets = tuple(p.__create_chunk_list__()[0].offsets) if isinstance(p, DTensor) else (0,) * p.dim()
            shards[n.replace("_checkpoint_wrapped_module.", "")] = (offsets, local_part.detach().numpy().copy())
        out[name] = {"shards": shards, "fetched": readers[-1].bytes_read}
    parts = [None] * world if rank == 0 else None
    dist.gather_object(out, parts, dst=0)
    return {"ranks": parts} if rank == 0 else {}


def _checkpoint(path):
    """A 2-layer Llama (width 64, 256 tokens) by transformers, in 3 safetensors files and an index."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    conf = tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1,
    )  # fmt: skip
    tf.LlamaForCausalLM(conf).save_pretrained(path, max_shard_size="150KB")
    assert len(list(path.glob("*.safetensors"))) >= 3
    return path


def test_pretrained_on_s3_is_read_by_range(tmp_path):
    from gloo_harness import launch_ranks
    from s3_server import s3_server
    from safetensors.torch import load_file

    from raytrain_hybrid.storage import open_store

    src = _checkpoint(tmp_path / "llama")
    files = sorted(src.glob("*.safetensors"))
    weights = {k: v for f in files for k, v in load_file(f).items()}
    total = sum(f.stat().st_size for f in files)
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    with s3_server() as env:
        open_store("s3://bucket/models/llama").upload(str(src))
        got = launch_ranks(_load_both, 2, str(src), "s3://bucket/models/llama", str(node_tmp), env=env)
    for rank, out in enumerate(got["ranks"]):
        local, s3 = out["local"]["shards"], out["s3"]["shards"]
        assert local.keys() == s3.keys() == weights.keys()
        split = 0
        for name, (offsets, values) in s3.items():
            assert offsets == local[name][0] and np.array_equal(values, local[name][1]), (rank, name)
            want = weights[name][tuple(slice(o, o + n) for o, n in zip(offsets, values.shape, strict=True))]
            assert np.array_equal(values, want.numpy()), (rank, name)
            split += values.shape != tuple(weights[name].shape)
        assert split >= 2 * 7 + 1, (rank, split)  # every matrix of every layer and the head are halves
        # Its half of the weights and two headers: well under the files' size.
        fetched = out["s3"]["fetched"]
        held = sum(v.nbytes for _, v in s3.values())
        assert held <= fetched < 0.6 * total, (rank, fetched, held, total)
    assert [p for p in node_tmp.rglob("*") if p.is_file()] == []  # nothing staged on the node
