"""dmattn.ring_attention over a real torch.distributed process group (gloo, CPU, 2 and 4 processes)
against single-process attention on the whole sequence."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import dmattn  # noqa: E402
from conftest import llm_like  # noqa: E402

N, HQ, HKV, D = 1024, 4, 2, 64
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no dependence on the host name resolving


def full_inputs():
    rng = np.random.default_rng(17)
    return (torch.from_numpy(llm_like(rng, (1, HQ, N, D))), torch.from_numpy(llm_like(rng, (1, HKV, N, D))),
            torch.from_numpy(llm_like(rng, (1, HKV, N, D))))


def shard(x, rank, world, sharding):
    if sharding == "contiguous":
        c = N // world
        return x[:, :, rank * c:(rank + 1) * c]
    c = N // (2 * world)
    return torch.cat([x[:, :, rank * c:(rank + 1) * c], x[:, :, (2 * world - 1 - rank) * c:(2 * world - rank) * c]], 2)


def worker(rank, world, sharding, causal, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        q, k, v = (shard(t, rank, world, sharding).contiguous() for t in full_inputs())
        out, lse = dmattn.ring_attention(q, k, v, causal=causal, sharding=sharding, return_lse=True, sink_tiles=1)
        np.save(f"{tmp}/out{rank}.npy", out.numpy())
        np.save(f"{tmp}/lse{rank}.npy", lse.numpy())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,sharding,causal", [(2, "zigzag", True), (4, "zigzag", True),
                                                   (2, "contiguous", True), (2, "zigzag", False)])
def test_ring_over_gloo_matches_single_process(tmp_path, world, sharding, causal):
    mp.spawn(worker, args=(world, sharding, causal, str(tmp_path)), nprocs=world, join=True)
    q, k, v = full_inputs()
    want, want_lse = dmattn.attention(q, k, v, causal=causal, return_lse=True, sink_tiles=1, smooth_k=False)
    got = torch.zeros_like(want)
    got_lse = torch.zeros_like(want_lse)
    for r in range(world):  # put the shards back in sequence order
        o = torch.from_numpy(np.load(tmp_path / f"out{r}.npy"))
        l_ = torch.from_numpy(np.load(tmp_path / f"lse{r}.npy"))
        idx = torch.arange(N).reshape(1, 1, N, 1)
        pos = shard(idx, r, world, sharding).flatten()
        got[:, :, pos] = o
        got_lse[:, :, pos] = l_
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 3e-3, rel  # P rounded to bf16 against each block's max
    assert torch.allclose(got_lse, want_lse, rtol=1e-5, atol=1e-4)


def test_ring_refuses_shards_of_partial_tiles(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        q = torch.zeros(1, 2, 200, 64)  # zigzag: two chunks of 100 tokens, not whole 128-token tiles
        with pytest.raises(ValueError, match="multiple of 128"):
            dmattn.ring_attention(q, q, q)
        with pytest.raises(ValueError, match="sharding"):
            dmattn.ring_attention(q, q, q, sharding="striped")
        one = torch.from_numpy(llm_like(np.random.default_rng(3), (1, 2, 256, 64)))
        # One rank holding the sequence in one chunk is one block call: single-process attention exactly.
        assert torch.equal(dmattn.ring_attention(one, one, one, sharding="contiguous"),
                           dmattn.attention(one, one, one, causal=True, smooth_k=False))
        with pytest.raises(ValueError, match="smooth_k"):  # its key mean would need an all-reduce
            dmattn.ring_attention(one, one, one, smooth_k=True)
    finally:
        dist.destroy_process_group()
