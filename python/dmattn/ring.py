"""Ring (context-parallel) attention over a torch.distributed process group.

Each rank holds a shard of the sequence: with sharding="zigzag" (default, equal causal work) the
sequence is cut into 2R chunks and rank r holds chunks r and 2R-1-r, concatenated; with
"contiguous" rank r holds chunk r. Key/value shards travel the ring (isend/irecv, overlapped with
the local block attention); each rank merges its partial results by LSE. The DMA policy and the
causal mask use absolute positions, so every (query tile, key tile) pair has the single-device
formats; outputs agree with single-device attention to bf16-P rounding (~1e-3 rel. L2).

The transport is torch.distributed: gloo for CPU tensors (tested with 2 and 4 processes), NCCL for
CUDA tensors, whose block attention runs on the GPU with the same position offsets (tested on one
rank; the NCCL transport across GPUs has not been run yet).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _merge(out, lse, o, l):
    """(out, lse) <- LSE merge of (out, lse) and (o, l); out [B,H,n,d] fp32, lse [B,H,n]."""
    if out is None:
        return o.float(), l
    new = torch.logaddexp(lse, l)
    out = out * torch.exp(lse - new).unsqueeze(-1) + o.float() * torch.exp(l - new).unsqueeze(-1)
    return out, new


def ring_attention(q, k, v, *, group=None, causal: bool = True, sharding: str = "zigzag", return_lse: bool = False,
                   **policy):
    """This rank's shard of DMA attention over the whole sequence.

    q: [B, Hq, n, d], k/v: [B, Hkv, n, d] torch tensors: this rank's shard (n tokens; for zigzag
    its two chunks concatenated, each n/2 tokens). The global length is n * world_size; chunk
    lengths must be multiples of 128. `policy` takes attention()'s keywords; its default is
    attention()'s without smooth_k, whose key mean spans the whole sequence (an all-reduce this
    schedule does not take: smooth_k=True raises). Returns the output shard [B, Hq, n, d] in q's
    dtype (and its LSE [B, Hq, n]).
    """
    from . import attention
    given = policy.get("policy")
    if policy.get("smooth_k") or (given is not None and given.smooth_k):
        raise ValueError("ring_attention: smooth_k needs the key mean of the whole sequence, an all-reduce the ring "
                         "does not take; pass smooth_k=False")
    if given is None:
        policy.setdefault("smooth_k", False)
    R, r = dist.get_world_size(group), dist.get_rank(group)
    n = q.shape[2]
    if sharding not in ("zigzag", "contiguous"):
        raise ValueError(f"sharding must be 'zigzag' or 'contiguous' (got {sharding!r})")
    nchunks = 2 if sharding == "zigzag" else 1
    chunk = n // nchunks
    if n % nchunks or chunk % 128:
        raise ValueError(f"each of the {nchunks} chunk(s) per rank must be a multiple of 128 tokens (shard has {n})")

    def chunks_of(rank):
        return [rank, 2 * R - 1 - rank] if sharding == "zigzag" else [rank]

    kv = torch.cat([k, v], dim=1).contiguous()  # one buffer travels the ring
    hk = k.shape[1]
    outs = [None] * nchunks
    lses = [None] * nchunks
    nxt, prv = (r + 1) % R, (r - 1) % R
    for step in range(R):
        src = (r - step) % R
        reqs = []
        if step + 1 < R:  # start passing this shard on while computing with it
            recv = torch.empty_like(kv)
            send_op = dist.P2POp(dist.isend, kv, dist.get_global_rank(group, nxt) if group else nxt, group)
            recv_op = dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, prv) if group else prv, group)
            reqs = dist.batch_isend_irecv([send_op, recv_op])
        kk, vv = kv[:, :hk], kv[:, hk:]
        for qi, qc in enumerate(chunks_of(r)):
            qs = q[:, :, qi * chunk:(qi + 1) * chunk]
            for ki, kc in enumerate(chunks_of(src)):
                if causal and kc > qc:
                    continue  # every key of that chunk is in this chunk's future
                o, l = attention(qs.contiguous(), kk[:, :, ki * chunk:(ki + 1) * chunk].contiguous(),
                                 vv[:, :, ki * chunk:(ki + 1) * chunk].contiguous(), causal=causal, return_lse=True,
                                 q_offset=qc * chunk, k_offset=kc * chunk, **policy)
                outs[qi], lses[qi] = _merge(outs[qi], lses[qi], o, l)
        for req in reqs:
            req.wait()
        if step + 1 < R:
            kv = recv
    out = torch.cat(outs, dim=2).to(q.dtype)
    lse = torch.cat(lses, dim=2)
    return (out, lse) if return_lse else out
