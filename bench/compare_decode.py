"""Decode step: dmattn over an MX KV cache vs PyTorch SDPA over a bf16 cache of the same length, same
run. B sequences x ctx tokens, Hq=32, Hkv=8, d=128, one new query per sequence.

SDPA: q [B,32,1,128], k/v [B,8,ctx,128] bf16, enable_gqa=True, each backend that accepts it (flash,
efficient, cuDNN), CUDA events over 20 steps; bytes = K + V + q + out. dmattn: bench_decode_cuda
(the GPU decode's enqueue: q quantization + kernel + split merge; and the synchronous call with its
NaN check), V in bf16 (pv = bf16), MXFP8 (pv = mxfp8) and MXFP4 (pv = mxfp4, beyond DESIGN). The copy
ceiling comes from the same binary. Prints one table last.

usage: python3 bench/compare_decode.py BUILD_DIR OUT_DIR [B ...]   (DMATTN_BENCH_COLD=1: every step with L2 evicted)
"""
import os
import subprocess
import warnings
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

warnings.filterwarnings("ignore")  # SDPA warns on every GQA call that a backend cannot take it
build, out_dir = sys.argv[1], sys.argv[2]
Bs = [int(b) for b in sys.argv[3:]] or [1, 16, 64]
ctxs = [8192, 32768, 131072]
Hq, Hkv, d = 32, 8, 128


# DMATTN_BENCH_COLD=1 (read by bench_decode_cuda too): each step timed alone after a 256 MiB write has
# evicted L2, as in a model, where the other layers' weights pass through L2 between two steps of a layer.
COLD = os.environ.get("DMATTN_BENCH_COLD") == "1"
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if COLD else None


def time_us(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    if COLD:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i, (a, b) in enumerate(ev):
            flush.fill_(i & 0xFF)
            a.record()
            fn()
            b.record()
        ev[-1][1].synchronize()
        return 1e3 * sum(a.elapsed_time(b) for a, b in ev) / iters
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / iters


sdpa = {}
for B in Bs:
    for ctx in ctxs:
        q = torch.randn(B, Hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
        best = None
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                         ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            except RuntimeError as e:
                print(f"sdpa {name} B={B} ctx={ctx}: not available ({str(e).splitlines()[0][:80]})", flush=True)
                continue
            print(f"sdpa {name} B={B} ctx={ctx}: {us:.1f} us, {nbytes / (us * 1e3):.0f} GB/s", flush=True)
            if best is None or us < best[1]:
                best = (name, us, nbytes)
        sdpa[(B, ctx)] = best
        del q, k, v
        torch.cuda.empty_cache()

out_txt, rows, copy, read = "", [], None, None
for pv in ("bf16", "mxfp8", "mxfp4"):
    res = subprocess.run([f"{build}/bench/bench_decode_cuda", pv] + ([str(Bs[0])] if len(Bs) == 1 else []),
                         capture_output=True, text=True)
    out_txt += res.stdout + res.stderr
    if res.returncode != 0:
        print(res.stdout, res.stderr)
        sys.exit(1)
    for line in res.stdout.splitlines():
        f = line.split()
        if f[:1] == ["copy"]:
            copy = float(f[1])
        if f[:1] == ["read"]:
            read = float(f[1])
        if f and f[0].startswith("dmattn-") and int(f[1]) in Bs:
            rows.append((f[0][7:], int(f[1]), int(f[2]), float(f[3]), float(f[4]), float(f[5]), float(f[6])))
open(f"{out_dir}/bench_decode.txt", "w").write(out_txt)

print(f"\ndecode step, Hq=32 Hkv=8 d=128, Nq=1; ceilings (same run): copy {copy:.0f} GB/s (read + write), "
      f"read-only {read:.0f} GB/s")
print("| V | B | context | SDPA best | µs | GB/s | of read | dmattn µs | synced µs | GB/s | of copy | of read | MB read | speedup |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for pv, B, ctx, us, us_sync, gbs, nbytes in rows:
    name, sus, sbytes = sdpa[(B, ctx)]
    sg = sbytes / (sus * 1e3)
    print(f"| {pv} | {B} | {ctx} | {name} | {sus:.1f} | {sg:.0f} | {100 * sg / read:.1f}% | {us:.1f} | {us_sync:.1f} | "
          f"{gbs:.0f} | {100 * gbs / copy:.1f}% | {100 * gbs / read:.1f}% | {nbytes / 1e6:.1f} | {sus / us:.2f}x |")
