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
device µs a call per kernel, largest first); HOST=1 adds the host's µs a call at a small shape
(dmattn, SDPA and the pieces of dmattn's Python path, calls queued without a sync); TIMELINE=1 adds,
per policy at those shapes and for SDPA's cuDNN backend, the last of three queued calls: its GPU work
in time order (each kernel's start and end, in µs from the call's start on the host, and its stream),
its host span and when its first CUDA call came, so the gaps and the critical path show; DECODE=1 adds decode through dmattn.KVCache (B=8, 8k
tokens, Hq 32 / Hkv 8, d 128, one new query) for each policy's cache-side transforms, against SDPA
over a bf16 cache; VARLEN=0 skips the tables of packed sequences (16 of 512-8192 tokens) and of a
sliding window (4096 keys at 32k tokens).
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
    (1, 16384, 64, 8, 128), (1, 16384, 32, 8, 64), (1, 8192, 32, 32, 128), (1, 16384, 16, 8, 256), (4, 4096, 8, 4, 256)]


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


def sdpa(q, k, v):
    """The SDPA call every table times (causal, GQA), under the caller's sdpa_kernel backend."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_ms(q, k, v, backend):
    with sdpa_kernel(backend):
        try:
            return timeit(lambda: sdpa(q, k, v))
        except RuntimeError:
            return float("nan")


def parse(spec):
    name, _, body = spec.partition("=")
    kw = {}
    for item in filter(None, body.split(",")):
        key, _, val = item.partition(":")
        if key in ("smooth_k", "smooth_q", "rotate") and val.isdigit():
            kw[key] = bool(int(val))  # (smooth_q also takes a name: smooth_q:high)
        else:
            kw[key] = int(val) if val.isdigit() else val
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


def profiled(fn, calls, host=False):
    """torch.profiler's record of `calls` calls of fn on the GPU (and the host's side, with host),
    after one unrecorded call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])) as prof:
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


def timeline(fn, calls=3):
    """The last of `calls` calls: its host span (Python included) and its GPU work in time order,
    as (start µs, end µs, stream, name) from the call's start on the host."""
    import json
    import tempfile
    from torch.profiler import record_function

    def marked():
        with record_function("dmattn-bench-call"):
            fn()
    prof = profiled(marked, calls, host=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    marks = [e for e in trace if e.get("name") == "dmattn-bench-call" and e.get("cat") == "user_annotation"]
    if not marks:
        raise RuntimeError("torch.profiler recorded no host ranges: the timeline needs its CPU activity")
    last = max(marks, key=lambda e: e["ts"])
    t0 = last["ts"]
    gpu = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] >= t0),
                 key=lambda e: e["ts"])
    launches = [e for e in trace if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t0 + last["dur"]]
    first_launch = min((e["ts"] for e in launches), default=t0) - t0
    rows = [(e["ts"] - t0, e["ts"] + e["dur"] - t0, e.get("args", {}).get("stream", "?"), e["name"]) for e in gpu]
    return last["dur"], first_launch, rows


def timeline_policies(policies, B, N):
    q, k, v = inputs(B, N, 32, 8, 128)
    for name, kw in policies:
        span, first, rows = timeline(lambda: dmattn.attention(q, k, v, causal=True, **kw))
        end = max((r[1] for r in rows), default=0.0)
        print(f"\n{name} {kw or ''} at {B} x {N}: host span {span:.1f} µs (first CUDA call at {first:.1f}), "
              f"GPU work ends at {end:.1f} µs")
        for a, b, stream, key in rows:
            print(f"  {a:8.1f} {b:8.1f} {b - a:8.1f}  s{stream}  {key[:90]}")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # (entered once, as sdpa_ms times it)
        span, first, rows = timeline(lambda: sdpa(q, k, v))
    print(f"\nSDPA cuDNN at {B} x {N}: host span {span:.1f} µs (first CUDA call at {first:.1f}), GPU work "
          + ", ".join(f"{a:.1f}-{b:.1f} {key[:40]}" for a, b, _, key in rows))
    del q, k, v


def host_us(fn, n, backend=None):
    """Host µs a call of fn: wall clock over n calls queued without a sync (after one call and a sync),
    so it measures the host's work as long as the GPU's work of a call is shorter. backend: SDPA's
    backend, chosen once outside the timed calls."""
    import time
    if backend is not None:
        with sdpa_kernel(backend):
            return host_us(fn, n)
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / n


def host_costs(N=256, Hq=32, Hkv=8, d=128, n=300):
    """Host µs a call, wall clock over n calls queued without a sync (the GPU work of a 256-token call
    is shorter than its host time), for dmattn.attention, SDPA and the pieces of dmattn's Python path."""
    q, k, v = inputs(1, N, Hq, Hkv, d)
    out = torch.empty_like(q)
    pol = dmattn.Policy()
    opts = dmattn._attention_options(True, None, pol, False, (-1, -1), torch.cuda.current_stream().cuda_stream)

    def guarded():
        with torch.cuda.device(q.device):
            pass
    rows = [
        ("dmattn.attention (check_finite)", lambda: dmattn.attention(q, k, v, causal=True)),
        ("dmattn.attention, check_finite=False", lambda: dmattn.attention(q, k, v, causal=True, check_finite=False)),
        ("attention_into alone (options made once)", lambda: dmattn.attention_into(q, k, v, out, None, "bhnd", opts)),
        ("SDPA cuDNN", lambda: sdpa(q, k, v), SDPBackend.CUDNN_ATTENTION),
        ("SDPA flash", lambda: sdpa(q, k, v), SDPBackend.FLASH_ATTENTION),
        ("torch.empty_like(q)", lambda: torch.empty_like(q)),
        ("torch.cuda.current_stream(dev).cuda_stream", lambda: torch.cuda.current_stream(q.device).cuda_stream),
        ("dmattn's stream lookup (raw)", lambda: dmattn._stream(q.device.index)),
        ("with torch.cuda.device(dev)", guarded),
        ("q.__dlpack__()", lambda: q.__dlpack__()),
        ("q.detach()", lambda: q.detach()),
        ("dmattn.Policy()", lambda: dmattn.Policy()),
        ("options struct", lambda: dmattn._attention_options(True, None, pol, False, (-1, -1), 0)),
    ]
    print(f"\n| host µs a call (1 x {N}, {Hq}/{Hkv}, {d}; {n} calls queued) | µs |")
    print("|---|---|")
    for name, fn, *backend in rows:
        print(f"| {name} | {host_us(fn, n, *backend):.1f} |", flush=True)
    del q, k, v, out


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


def varlen(count=16, lo=512, hi=8192, Hq=32, Hkv=8, d=128):
    """Packed sequences of random lengths (flash-attn's varlen layout) in one dmattn call, against a
    dmattn call a sequence, SDPA over the batch padded to its longest sequence (causal; real tokens
    first, so top-left causal is each sequence's own), and an SDPA call a sequence."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    total, longest = sum(lens), max(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    gd = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(total, Hq, d, device="cuda", dtype=torch.bfloat16, generator=gd)
    k = torch.randn(total, Hkv, d, device="cuda", dtype=torch.bfloat16, generator=gd)
    v = torch.randn(total, Hkv, d, device="cuda", dtype=torch.bfloat16, generator=gd)
    spans = [(int(a), int(b)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    per = [tuple(t[a:b].transpose(0, 1)[None] for t in (q, k, v)) for a, b in spans]
    pad = lambda t: torch.stack([torch.nn.functional.pad(t[a:b], (0, 0, 0, 0, 0, longest - (b - a))) for a, b in spans]
                                ).transpose(1, 2).contiguous()  # noqa: E731
    qp, kp, vp = pad(q), pad(k), pad(v)
    one = timeit(lambda: dmattn.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=longest, max_seqlen_k=longest))
    each = timeit(lambda: [dmattn.attention(*x, causal=True) for x in per])
    padded = {n: sdpa_ms(qp, kp, vp, b) for n, b in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))}

    def sdpa_each(backend):
        with sdpa_kernel(backend):
            try:
                return timeit(lambda: [sdpa(*x) for x in per])
            except RuntimeError:
                return float("nan")
    looped = {n: sdpa_each(b) for n, b in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))}
    best = min(x for x in list(padded.values()) + list(looped.values()) if x == x)
    tflops = sum(2 * 2 * n * (n + 1) / 2 * Hq * d for n in lens) / (one * 1e-3) / 1e12
    print(f"\n| varlen: {count} sequences of {lo}-{hi} tokens ({total} in all), {Hq}/{Hkv}, {d}, causal | ms | vs best SDPA |")
    print("|---|---|---|")
    print(f"| dmattn, one call (cu_seqlens) | {one:.3f} | {best / one:.2f}x ({tflops:.0f} TFLOP/s) |")
    print(f"| dmattn, a call a sequence | {each:.3f} | {best / each:.2f}x |")
    for n in padded:
        print(f"| SDPA {n}, padded to {longest} | {padded[n]:.3f} | {best / padded[n]:.2f}x |")
        print(f"| SDPA {n}, a call a sequence | {looped[n]:.3f} | {best / looped[n]:.2f}x |", flush=True)
    del q, k, v, qp, kp, vp, per


def window(N=32768, left=4096, Hq=32, Hkv=8, d=128):
    """A sliding window (a query sees the `left` keys before it and itself: flash-attn's window_size
    (left, 0)) at one long sequence; SDPA has no window short of an N x N mask, so its causal time over
    the whole sequence stands beside it as what a caller without windows pays."""
    q, k, v = inputs(1, N, Hq, Hkv, d)
    ms = timeit(lambda: dmattn.attention(q, k, v, causal=True, window=(left, 0)))
    full = timeit(lambda: dmattn.attention(q, k, v, causal=True))
    best = min(x for x in (sdpa_ms(q, k, v, SDPBackend.CUDNN_ATTENTION), sdpa_ms(q, k, v, SDPBackend.FLASH_ATTENTION))
               if x == x)
    print(f"\n| window ({left}, 0) at 1 x {N}, {Hq}/{Hkv}, {d} | ms | vs best SDPA causal (no window) |")
    print("|---|---|---|")
    print(f"| dmattn, window | {ms:.3f} | {best / ms:.2f}x |")
    print(f"| dmattn, causal | {full:.3f} | {best / full:.2f}x |", flush=True)
    del q, k, v


def main():
    policies = [("default", {})] + [parse(s) for s in sys.argv[1:]]
    rounds = int(os.environ.get("ROUNDS", "1"))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    with torch.inference_mode():
        if os.environ.get("SHAPES", "1") != "0":
            prefill_matrix()
        if os.environ.get("VARLEN", "1") != "0":
            varlen()
            window()
        for shape in os.environ.get("POLICY_SHAPES", "1x16384").split():
            B, N = (int(x) for x in shape.split("x"))
            prefill_policies(policies, rounds, B, N)
            if os.environ.get("PROFILE", "0") == "1":
                profile_policies(policies, B, N)
            if os.environ.get("TIMELINE", "0") == "1":
                timeline_policies(policies, B, N)
        if os.environ.get("HOST", "0") == "1":
            host_costs()
        if os.environ.get("DECODE", "0") == "1":
            decode_policies(policies, rounds)


if __name__ == "__main__":
    main()
