"""A checkpoint of whole tensors loaded in shards reads each shard's rows only.

Two gloo ranks save whole (replicated) tensors with DCP, as ZeRO-1's dp replicas do, locally
and in a bucket of the loopback S3 server; then each loads them as row shards and as column
shards (FSDP's and TP's splits) through ``checkpoint.reader.safe_load``: the values are the
saved ones, and each rank fetches its part of each large entry plus a few KB (the metadata and
the archives' structure), about half of the checkpoint, where DCP's own reader fetches every
entry whole.
"""

from __future__ import annotations


def _save_and_load(rank: int, world: int, local: str, uri: str) -> list:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from raytrain_hybrid.checkpoint.reader import safe_load
    from raytrain_hybrid.storage import open_store

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    # Over entry_ranges.MIN_BYTES each, in uneven halves.
    full = {"w": torch.randn(161, 501, generator=g), "b": torch.randn(101, 1401, generator=g).to(torch.bfloat16)}
    saved = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in full.items()}
    dcp.save({**saved, "step": torch.tensor(3.0)}, checkpoint_id=local)
    dist.barrier()
    if rank == 0:
        open_store(uri).upload(local)
    dist.barrier()
    got = []
    for where in (local, uri):
        for placement in (Shard(0), Shard(1)):
            state = {k: distribute_tensor(torch.zeros_like(v), mesh, [placement]) for k, v in full.items()}
            state["step"] = torch.tensor(0.0)
            reader = safe_load(state, where)
            same = all(torch.equal(state[k].full_tensor(), v) for k, v in full.items()) and state["step"].item() == 3
            held = sum(state[k].to_local().nbytes for k in full)
            got.append((where, str(placement), same, reader.bytes_read, held))
    parts = [None] * world if rank == 0 else None
    dist.gather_object(got, parts, dst=0)
    return parts


def test_whole_tensors_load_as_shards_reading_only_their_rows(tmp_path):
    from gloo_harness import launch_ranks
    from s3_server import s3_server

    local = tmp_path / "ckpt"
    with s3_server() as env:
        ranks = launch_ranks(_save_and_load, 2, str(local), "s3://bucket/ckpt", env=env)
    size = sum(p.stat().st_size for p in local.iterdir())
    assert len(ranks) == 2 and all(len(r) == 4 for r in ranks)
    for rank in ranks:
        for where, placement, same, fetched, held in rank:
            assert same, (where, placement)
            # Its rows, the metadata and the archives' structure (a few KB); a whole entry is 2x its part.
            assert held < fetched < held + 0.04 * size and fetched < 0.55 * size, (where, placement, fetched, held)
