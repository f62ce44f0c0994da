#!/usr/bin/env python3
"""Prefill as users call it: dmattn.attention on torch tensors (bf16 in and out, causal, torch's
current stream) against torch.nn.functional.scaled_dot_product_attention's cuDNN and flash backends,
same process, a matrix of shapes; then the policies given on the command line at one shape.

Usage: python3 bench/bench_python.py [POLICY ...]   (POLICY: name=key:value,key:value, e.g.
       rot=rotate:1,smooth_k:1,scale_rule:ceil; values 0/1 are booleans, digits ints)
Environment: SHAPES=0 skips the shape matrix; ROUNDS=n times the policies n times, interleaved,
and reports each one's median over the rounds (differences of a few percent need that);
POLICY_SHAPES="BxN ..." the shapes the policies run at (default 1x16384; Hq 32, Hkv 8, d 128);
PROFILE=1 adds, per policy at each of those shapes, where a call's GPU time goes (torch.profiler:
device µs a call per kernel, largest first); DECODE=1 adds decode through dmattn.KVCache (B=8, 8k
tokens, Hq 32 / Hkv 8, d 128, one new query) for each policy's cache-side transforms, against SDPA
over a bf16 cache.
Prints one table a section: ms (median of CUDA-event timings) and the ratio to the best SDPA backend.
"""
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dmattn

SHAPES = [  # B, N, Hq, Hkv, d
    (1, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (4, 4096, 32, 8, 128), (8, 2048, 32, 8, 128),
    (1, 16384, 64, 8, 128), (1, 16384, 32, 8, 64), (1, 8192, 32, 32, 128)]


def timeit(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(iters):
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def inputs(B, N, Hq, Hkv, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def sdpa_ms(q, k, v, backend):
    with sdpa_kernel(backend):
        try:
            return timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        except RuntimeError:
            return float("nan")


def parse(spec):
    name, _, body = spec.partition("=")
    kw = {}
    for item in filter(None, body.split(",")):
        key, _, val = item.partition(":")
        kw[key] = bool(int(val)) if key in ("smooth_k", "smooth_q", "rotate") else int(val) if val.isdigit() else val
    return name, kw


def prefill_matrix():
    print("\n| B x N, Hq/Hkv, d | cuDNN ms | flash ms | dmattn ms | vs best SDPA | unchecked ms |")
    print("|---|---|---|---|---|---|")
    for B, N, Hq, Hkv, d in SHAPES:
        q, k, v = inputs(B, N, Hq, Hkv, d)
        cud, fla = sdpa_ms(q, k, v, SDPBackend.CUDNN_ATTENTION), sdpa_ms(q, k, v, SDPBackend.FLASH_ATTENTION)
        ms = timeit(lambda: dmattn.attention(q, k, v, causal=True))
        unchecked = timeit(lambda: dmattn.attention(q, k, v, causal=True, check_finite=False))
        best = min(x for x in (cud, fla) if x == x)
        print(f"| {B} x {N}, {Hq}/{Hkv}, {d} | {cud:.3f} | {fla:.3f} | {ms:.3f} | {best / ms:.2f}x | {unchecked:.3f} |",
              flush=True)
        del q, k, v


def prefill_policies(policies, rounds, B, N):
    q, k, v = inputs(B, N, 32, 8, 128)
    best = min(sdpa_ms(q, k, v, SDPBackend.CUDNN_ATTENTION), sdpa_ms(q, k, v, SDPBackend.FLASH_ATTENTION))
    times = {name: [] for name, _ in policies}
    for _ in range(rounds):
        for name, kw in policies:
            times[name].append(timeit(lambda: dmattn.attention(q, k, v, causal=True, **kw)))
    print(f"\n| policy ({B} x {N}, 32/8, 128; median of {rounds} rounds) | ms | vs best SDPA | vs first |")
    print("|---|---|---|---|")
    base = None
    for name, kw in policies:
        ms = statistics.median(times[name])
        base = base or ms
        print(f"| {name} {kw or ''} | {ms:.3f} | {best / ms:.2f}x | {ms / base - 1:+.1%} |", flush=True)
    del q, k, v


def profiled(fn, calls):
    """torch.profiler's record of `calls` calls of fn on the GPU, after one unrecorded call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def kernels(fn, calls=5):
    """Device µs a call per kernel name (torch.profiler), largest first, and their sum."""
    prof = profiled(fn, calls)
    rows = [(e.device_time_total / calls, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(reverse=True)
    return rows, sum(us for us, _ in rows)


def profile_policies(policies, B, N):
    q, k, v = inputs(B, N, 32, 8, 128)
    for name, kw in policies:
        rows, total = kernels(lambda: dmattn.attention(q, k, v, causal=True, **kw))
        print(f"\n{name} {kw or ''} at {B} x {N}: {total:.1f} µs of kernels a call")
        for us, key in rows:
            print(f"  {us:9.1f}  {key[:100]}")
    del q, k, v


def decode_policies(policies, rounds):
    B, L, Hq, Hkv, d = 8, 8192, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(B, Hkv, L, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, L, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, Hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    best = min(timeit(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) for _ in range(2))
    kh, vh = k.float().cpu().numpy(), v.float().cpu().numpy()
    caches = {}
    for name, kw in policies:
        pol = dmattn.Policy(**{f: x for f, x in kw.items() if f != "smooth_q"})
        cache = dmattn.KVCache(Hkv, d, pol)
        ids = [cache.new_sequence() for _ in range(B)]
        for i in ids:
            cache.append(i, kh[i:i + 1], vh[i:i + 1])
        caches[name] = (cache, ids)
    times = {name: [] for name, _ in policies}
    for _ in range(rounds):
        for name, _ in policies:
            cache, ids = caches[name]
            times[name].append(timeit(lambda: dmattn.decode(cache, ids, q)))
    print(f"\n| decode policy (B={B}, {L} tokens, {Hq}/{Hkv}, {d}, Nq=1; median of {rounds} rounds) "
          "| µs | vs SDPA bf16 cache | vs first |")
    print("|---|---|---|---|")
    base = None
    for name, kw in policies:
        us = 1000 * statistics.median(times[name])
        base = base or us
        print(f"| {name} {kw or ''} | {us:.1f} | {1000 * best / us:.2f}x | {us / base - 1:+.1%} |", flush=True)


def main():
    policies = [("default", {})] + [parse(s) for s in sys.argv[1:]]
    rounds = int(os.environ.get("ROUNDS", "1"))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    with torch.inference_mode():
        if os.environ.get("SHAPES", "1") != "0":
            prefill_matrix()
        for shape in os.environ.get("POLICY_SHAPES", "1x16384").split():
            B, N = (int(x) for x in shape.split("x"))
            prefill_policies(policies, rounds, B, N)
            if os.environ.get("PROFILE", "0") == "1":
                profile_policies(policies, B, N)
        if os.environ.get("DECODE", "0") == "1":
            decode_policies(policies, rounds)


if __name__ == "__main__":
    main()
