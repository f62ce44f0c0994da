#!/usr/bin/env python3
"""A generation step as users run it, from Python: dmattn.PagedKVCache (the KV cache in GPU memory)
against torch.nn.functional.scaled_dot_product_attention over a bf16 cache, same process.

For each (B, ctx) and pv mode: Hq=32, Hkv=8, d=128, one new query a sequence.
  fill    one append of the B x ctx prompt tokens (bf16 CUDA tensors) into a new cache (its pool's
          growth included, the kernels loaded by a small append first), and into a cache that
          reserve()d the room first (as a server sizes its pool ahead), against a bf16 copy of the
          same K and V (the ceiling a cache write is measured by);
  step    append(1 token a sequence) + decode, the work of one decode step of one layer;
  decode  the decode alone;
  graph   the step captured in a CUDA graph, replayed after PagedKVCache.prepare() (the host's
          bookkeeping of the step), per step;
  SDPA    over a bf16 cache [B, 8, ctx + 1, 128], the better of the cuDNN and flash backends: a step
          (the new K and V written into the cache with index_copy_, then
          scaled_dot_product_attention), eager and replayed from a CUDA graph; and the attention alone.
Speedups: SDPA's step over dmattn's (eager; graph over graph), SDPA's attention over dmattn's decode.
Times are medians of CUDA-event timings over 20 steps on torch's current stream, which is where the
calls enqueue their work (no host synchronisation inside a step). Prints one markdown table.

usage: POLICY=key:value,... python3 bench/bench_decode_step.py [--profile] [B:ctx ...]
       POLICY=... python3 bench/bench_decode_step.py --host B:ctx ...
       POLICY (optional): policy fields over the default's, e.g. diag_tiles:1,sink_tiles:0,rotate:0;
       B:ctx default: the matrix B 1, 16, 64 x ctx 8k, 32k, 128k where the bf16 cache fits in a
       quarter of the GPU's memory; --profile also prints each step's kernels, eager and graphed,
       and the fill's (device µs a step or a fill, torch.profiler); --host prints instead the host's µs a
       call of an eager step and of its pieces (calls queued without a sync), SDPA's beside them
"""
import os
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dmattn
from bench_python import host_us, parse, profiled

warnings.filterwarnings("ignore")  # SDPA warns on every GQA call that a backend cannot take it
Hq, Hkv, d = 32, 8, 128
PROFILE = False  # --profile: each step's kernels (kernels())


def time_ms(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def graphed(fn):
    """fn captured in a CUDA graph (after one eager warm-up run on a side stream, as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def sdpa_ms(q, kc, vc, new_k, new_v):
    """The better backend's times over a bf16 cache kc, vc [B, Hkv, ctx + 1, d]: the attention alone
    over its first ctx tokens (eager), and a step as a bf16-cache decode loop runs it, the new
    token's K and V written into the cache (index_copy_) then the attention over ctx + 1 tokens,
    eager and replayed from a CUDA graph."""
    ctx = kc.shape[2] - 1
    k, v = kc[:, :, :ctx], vc[:, :, :ctx]
    pos = torch.tensor([ctx], device=kc.device)

    def step():
        kc.index_copy_(2, pos, new_k)
        vc.index_copy_(2, pos, new_v)
        return F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
    best, best_step, best_graph = float("inf"), float("inf"), float("inf")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(backend):
            try:
                best = min(best, time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
                best_step = min(best_step, time_ms(step))
                best_graph = min(best_graph, time_ms(graphed(step).replay))
            except RuntimeError:
                pass
    return best, best_step, best_graph


def graph_step(cache, ids, q, new_k, new_v):
    """append + decode captured once; the step: prepare() + replay."""
    cache.reserve(len(ids), cache.length(ids[0]) + 64)
    g = graphed(lambda: (cache.append(ids, new_k, new_v), dmattn.decode(cache, ids, q)))

    def step():
        cache.prepare(ids, 1)
        g.replay()
    return step


def kernels(fn, steps=20):
    """Where a step's GPU time goes (torch.profiler): device µs a step per kernel or copy, largest
    first, and the span from the first op's start to the last op's end over `steps` steps, a step.
    A programmatic dependent's time counts from its launch, which may precede its predecessor's end."""
    prof = profiled(fn, steps)
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = {}
    for e in ops:
        name = e.name.split("(")[0].replace("void ", "")
        per[name] = per.get(name, 0.0) + e.device_time / steps
    span = (max(e.time_range.end for e in ops) - min(e.time_range.start for e in ops)) / steps if ops else 0.0
    return sorted(per.items(), key=lambda kv: -kv[1]), span


def print_kernels(label, fn, steps=20, unit="step"):
    per, span = kernels(fn, steps)
    print(f"  {label}: GPU span {span:.1f} us a {unit}; " + ", ".join(f"{n} {us:.1f}" for n, us in per), flush=True)


def policy_fields():
    """POLICY's fields, read as bench_python.py reads a policy on its command line."""
    return parse("POLICY=" + os.environ.get("POLICY", ""))[1]


def run(B, ctx, rows):
    g = torch.Generator(device="cuda").manual_seed(B * 7 + ctx)
    kc = torch.randn(B, Hkv, ctx + 1, d, device="cuda", dtype=torch.bfloat16, generator=g)  # SDPA's bf16 cache
    vc = torch.randn(B, Hkv, ctx + 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = kc[:, :, :ctx], vc[:, :, :ctx]  # the prompt's keys and values
    q = torch.randn(B, Hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    new_k = torch.randn(B, Hkv, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    new_v = torch.randn(B, Hkv, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sdpa, sdpa_step, sdpa_graph = sdpa_ms(q, kc, vc, new_k, new_v)
    copy = time_ms(lambda: (kc.clone(), vc.clone()), iters=5)  # contiguous: the ceiling of a copy
    torch.cuda.empty_cache()  # the clones' blocks: the cache's pool needs the room
    for pv in ("bf16", "mxfp4"):
        warm = dmattn.PagedKVCache(Hkv, d, pv=pv, **FIELDS)  # loads the append kernels (CUDA loads modules lazily)
        warm.append([warm.new_sequence() for _ in range(B)], k[:, :, :300], v[:, :, :300])
        del warm
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def timed_fill(cache, ids):
            torch.cuda.synchronize()
            a.record()
            cache.append(ids, k, v)
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b)
        room = dmattn.PagedKVCache(Hkv, d, pv=pv, **FIELDS)  # a pool sized ahead, as a server sizes it
        room_ids = [room.new_sequence() for _ in range(B)]
        room.reserve(B, ctx + 64)
        reserved = timed_fill(room, room_ids)
        del room
        cache = dmattn.PagedKVCache(Hkv, d, pv=pv, **FIELDS)
        ids = [cache.new_sequence() for _ in range(B)]
        fill = timed_fill(cache, ids)
        if PROFILE:  # the fill's kernels: each profiled call appends the prompt to a new cache
            def fill_new():
                c = dmattn.PagedKVCache(Hkv, d, pv=pv, **FIELDS)
                c.append([c.new_sequence() for _ in range(B)], k, v)
            print_kernels(f"B={B} ctx={ctx} pv={pv} fill", fill_new, steps=3, unit="fill")
        decode = time_ms(lambda: dmattn.decode(cache, ids, q))

        def step():
            cache.append(ids, new_k, new_v)
            dmattn.decode(cache, ids, q)
        step_ms = time_ms(step)
        if PROFILE:
            print_kernels(f"B={B} ctx={ctx} pv={pv} eager step", step)
        replayed = graph_step(cache, ids, q, new_k, new_v)
        graph = time_ms(replayed)
        if PROFILE:
            print_kernels(f"B={B} ctx={ctx} pv={pv} graph step", replayed)
        rows.append((B, ctx, pv, fill, reserved, copy, step_ms, decode, graph, sdpa, sdpa_step, sdpa_graph, cache.page_bytes / 128))
        print(f"B={B} ctx={ctx} pv={pv}: fill {fill:.2f} ms (reserved {reserved:.2f}, bf16 copy {copy:.2f}), step {1000 * step_ms:.1f} us, "
              f"decode {1000 * decode:.1f} us, graph step {1000 * graph:.1f} us; SDPA step {1000 * sdpa_step:.1f} us "
              f"(graph {1000 * sdpa_graph:.1f}), attention alone {1000 * sdpa:.1f}", flush=True)
        del cache
        torch.cuda.empty_cache()


def host_step(B, ctx, n=100):
    """The host's µs a call of an eager step (V in MXFP4) and of its pieces, SDPA's step beside them."""
    g = torch.Generator(device="cuda").manual_seed(B * 7 + ctx)
    kc = torch.randn(B, Hkv, ctx + 1 + 4 * n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    q = torch.randn(B, Hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    new_k, new_v = kc[:, :, ctx:ctx + 1].clone(), vc[:, :, ctx:ctx + 1].clone()
    cache = dmattn.PagedKVCache(Hkv, d, pv="mxfp4", **FIELDS)
    ids = [cache.new_sequence() for _ in range(B)]
    cache.reserve(B, ctx + 8 * n)
    cache.append(ids, kc[:, :, :ctx], vc[:, :, :ctx])
    out = torch.empty_like(q)
    stream = dmattn._stream(q.device.index)
    opts = dmattn._decode_options(None, 0, -1, stream)
    pos = torch.tensor([ctx], device="cuda")

    def sdpa_step():
        kc.index_copy_(2, pos, new_k)
        vc.index_copy_(2, pos, new_v)
        return F.scaled_dot_product_attention(q, kc[:, :, :ctx + 1], vc[:, :, :ctx + 1], enable_gqa=True)
    rows = [
        ("step: append + decode", lambda: (cache.append(ids, new_k, new_v), dmattn.decode(cache, ids, q))),
        ("dmattn.decode", lambda: dmattn.decode(cache, ids, q)),
        ("PagedKVCache.append", lambda: cache.append(ids, new_k, new_v)),
        ("compiled decode_into (options made once)", lambda: dmattn.decode_into(cache._c, ids, q, out, None, opts)),
        ("compiled append", lambda: cache._c.append(ids, new_k, new_v, stream)),
        ("torch.empty_like(q)", lambda: torch.empty_like(q)),
        ("dmattn's stream lookup", lambda: dmattn._stream(q.device.index)),
        ("SDPA step (cuDNN): 2 index_copy_ + attention", sdpa_step, SDPBackend.CUDNN_ATTENTION),
        ("SDPA step (flash)", sdpa_step, SDPBackend.FLASH_ATTENTION),
    ]
    print(f"\n| host µs a call (B {B}, ctx {ctx}, {Hq}/{Hkv}, d {d}; {n} calls queued) | µs |")
    print("|---|---|")
    for name, fn, *backend in rows:
        print(f"| {name} | {host_us(fn, n, *backend):.1f} |", flush=True)


def main():
    global PROFILE, FIELDS
    FIELDS = policy_fields()
    if sys.argv[1:2] == ["--host"]:
        with torch.inference_mode():
            for s in sys.argv[2:] or ["1:8192"]:
                host_step(*(int(x) for x in s.split(":")))
        return
    args = [a for a in sys.argv[1:] if a != "--profile"]
    PROFILE = len(args) < len(sys.argv) - 1
    specs = [tuple(int(x) for x in s.split(":")) for s in args]
    if not specs:
        free = torch.cuda.get_device_properties(0).total_memory / 4
        specs = [(B, c) for B in (1, 16, 64) for c in (8192, 32768, 131072) if 2 * B * Hkv * c * d * 2 <= free]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, policy {dmattn.Policy(pv='bf16', **FIELDS)}")
    rows = []
    with torch.inference_mode():
        for B, ctx in specs:
            try:
                run(B, ctx, rows)
            except (dmattn.DmattnError, torch.OutOfMemoryError) as e:  # a shape too big for this GPU: say so, go on
                print(f"B={B} ctx={ctx}: not run ({e})", flush=True)
                torch.cuda.empty_cache()
    print("\n| B | ctx | pv | fill ms (reserved; bf16 copy) | step µs | graph step µs | decode µs | SDPA step µs (graph) | "
          "SDPA attention µs | step speedup | graph speedup | decode speedup | bytes/token (bf16 4096) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, ctx, pv, fill, reserved, copy, step, dec, graph, sdpa, sdpa_step, sdpa_graph, bpt in rows:
        print(f"| {B} | {ctx} | {pv} | {fill:.2f} ({reserved:.2f}; {copy:.2f}) | {1000 * step:.1f} | {1000 * graph:.1f} | "
              f"{1000 * dec:.1f} | {1000 * sdpa_step:.1f} ({1000 * sdpa_graph:.1f}) | {1000 * sdpa:.1f} | "
              f"{sdpa_step / step:.2f}x | {sdpa_graph / graph:.2f}x | {sdpa / dec:.2f}x | {bpt:.0f} |")

if __name__ == "__main__":
    main()
