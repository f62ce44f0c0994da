#!/usr/bin/env python3
"""Same-run comparison on the GPU: dmattn (CUDA backend; quality through `dmattn run --backend cuda`, time
in-process on device-resident bf16 tensors with bf16 output, as SDPA is timed, plus the CLI's own time) against
PyTorch SDPA bf16 (flash and cuDNN backends), the unfused quantize->dequantize->SDPA pipeline and,
where importable (bench/device.sh installs the wheel scripts/device_deps.sh fetched), SageAttention
1.0.6 (INT8 Q.K^T, fp16 P.V, Triton), with the ceilings measured in the same run (bf16 and fp8
matmul, device copy). Prints one table; "vs best SDPA" is against the faster SDPA backend.

Usage: python3 bench/compare_sdpa.py BUILD_DIR OUT_DIR [N ...]
"""
import os, re, subprocess, sys, tempfile
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

build, out = sys.argv[1], sys.argv[2]
Ns = [int(x) for x in sys.argv[3:]] or [4096, 16384]
B, HQ, HKV = 1, 32, 8
dev = "cuda"


def timeit(fn, iters=10):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def ceilings():
    n = 8192
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = timeit(lambda: x @ y)
    bf16 = 2 * n**3 / ms / 1e9
    xf = x.to(torch.float8_e4m3fn)
    yf = y.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.tensor(1.0, device=dev)
    ms8 = timeit(lambda: torch._scaled_mm(xf, yf, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    fp8 = 2 * n**3 / ms8 / 1e9
    buf = torch.empty(1 << 28, device=dev, dtype=torch.uint8)  # 256 MiB
    dst = torch.empty_like(buf)
    msc = timeit(lambda: dst.copy_(buf))
    return bf16, fp8, 2 * buf.numel() / msc / 1e6


try:
    from sageattention import sageattn
except Exception as e:  # not carried, or it does not import here: the row says so
    sageattn = None
    print(f"sageattention: unavailable ({str(e).splitlines()[0][:80]})")


def sage_rows(res, q, k, v, rel=None):
    """SageAttention's row (its own GQA, smooth_k on, its default); a failure prints and adds nothing."""
    if sageattn is None:
        return
    try:
        fn = lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=True)
        res["sageattention 1.0.6"] = (timeit(fn, iters=5), rel(fn()) if rel else float("nan"))
    except Exception as e:
        print(f"sageattention N={q.shape[2]} d={q.shape[3]}: failed ({str(e).splitlines()[0][:80]})")


def sdpa(q, k, v, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def mx_fake_quant(x, bits):
    """Quantize->dequantize along d in 32-blocks (MXFP8 E4M3 / MXFP4 E2M1, ocp rule), in torch."""
    shp = x.shape
    xb = x.float().reshape(*shp[:-1], shp[-1] // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    emax = 8 if bits == 8 else 2
    scale = torch.exp2(torch.floor(torch.log2(amax)) - emax)
    y = xb / scale
    if bits == 8:
        y = y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device=x.device)
        a = y.abs().clamp(max=6)
        idx = (a.unsqueeze(-1) - grid).abs().argmin(-1)
        y = grid[idx] * y.sign()
    return (y * scale).reshape(shp).to(x.dtype)


# The dmattn rows' times: bench_prefill_cuda, one process a policy. In one process a policy timed after
# another one could run up to 6% slower (pv=fp8 after the default: bench/RESULTS.md), and a
# model runs one policy throughout. Last, the default with check_finite = false (no read-back of the NaN/Inf
# flags, stream-ordered as SDPA is). {policy name as printed: median ms}
def prefill_times(N, d, iters):
    out = {}
    for pol in ["DMA-default", "all-MXFP8", "all-MXFP4", "DMA-pv-fp8", "DMA-NVFP4", "DMA-default nocheck"]:
        r = subprocess.run([os.path.join(build, "bench", "bench_prefill_cuda"), str(N), str(d), str(iters), *pol.split()],
                           capture_output=True, text=True)
        for line in r.stdout.splitlines():
            _, name, _, _, ms, _ = line.split()
            out[name] = float(ms)
        if r.returncode != 0:
            print(f"bench_prefill_cuda N={N} d={d} {pol}: failed: {r.stderr.strip()}")
    return out


rows = []
tmp = tempfile.mkdtemp()  # large .npy files stay off $OUT
bf16_peak, fp8_peak, copy_gbs = ceilings()
print(f"ceilings (same run): bf16 matmul {bf16_peak:.0f} TFLOP/s, fp8 matmul {fp8_peak:.0f} TFLOP/s, copy {copy_gbs:.0f} GB/s")
for N in Ns:
    torch.manual_seed(N)
    d = 128
    q = torch.randn(B, HQ, N, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, N, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, N, d, device=dev, dtype=torch.bfloat16)
    flops = 2 * B * HQ * N * N * d  # the convention
    g = HQ // HKV
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                             v.float().repeat_interleave(g, 1), is_causal=True)
    def rel(o):
        return ((o.float() - ref).norm() / ref.norm()).item()
    res = {}
    for name, be in [("sdpa flash bf16", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn bf16", SDPBackend.CUDNN_ATTENTION)]:
        try:
            ms = timeit(lambda: sdpa(q, k, v, be))
            res[name] = (ms, rel(sdpa(q, k, v, be)))
        except Exception as e:  # a backend that cannot run this shape says so
            print(f"{name}: unavailable ({str(e).splitlines()[0][:80]})")
    sage_rows(res, q, k, v, rel)
    ms = timeit(lambda: sdpa(mx_fake_quant(q, 8), mx_fake_quant(k, 4), v, SDPBackend.FLASH_ATTENTION), iters=3)
    res["unfused q->dq->sdpa (mxfp4 K)"] = (ms, rel(sdpa(mx_fake_quant(q, 8), mx_fake_quant(k, 4), v, SDPBackend.FLASH_ATTENTION)))
    # dmattn through its CLI on the same inputs (fp16 .npy: bf16 -> fp16 is exact for N(0,1) data in range).
    files = {}
    for nm, t in (("q", q), ("k", k), ("v", v)):
        files[nm] = os.path.join(tmp, f"{nm}.npy")
        np.save(files[nm], t.to(torch.float16).cpu().numpy())
    for pol, extra in [("dmattn DMA default", []), ("dmattn all-MXFP8", ["--low", "mxfp8-e4m3"]),
                       ("dmattn all-MXFP4", ["--high", "mxfp4"]), ("dmattn DMA pv=fp8", ["--pv", "fp8"]),
                       ("dmattn DMA-NVFP4", ["--low", "nvfp4"])]:
        o = os.path.join(tmp, "o.npy")
        cmd = [os.path.join(build, "dmattn"), "run", "--q", files["q"], "--k", files["k"], "--v", files["v"],
               "--out", o, "--causal", "--backend", "cuda", "--repeat", "5"] + extra
        r = subprocess.run(cmd, capture_output=True, text=True)
        m = re.search(r"in ([0-9.]+) s", r.stderr)
        if r.returncode != 0 or not m:
            print(f"{pol}: failed: {r.stderr.strip()}")
            continue
        err = rel(torch.from_numpy(np.load(o)).to(dev))
        res[pol] = (float("nan"), err)  # timed below, in-process
        if pol == "dmattn DMA default":  # the CLI's own time: fp16 in, f32 out, LSE, on staged copies
            res[pol + " (CLI)"] = (float(m.group(1)) * 1e3, err)
    # The times of the dmattn rows: the C++ API on device-resident bf16 tensors, bf16 out, no LSE (what SDPA
    # is timed doing), from bench_prefill_cuda on fresh N(0,1) inputs of the same shapes.
    for pol, ms in prefill_times(N, 128, 10).items():
        name = {"DMA-default": "dmattn DMA default", "DMA-pv-fp8": "dmattn DMA pv=fp8",
                "DMA-default-nocheck": "dmattn DMA default (unchecked)"}.get(pol, "dmattn " + pol)
        if name == "dmattn DMA default (unchecked)":
            res[name] = (ms, res.get("dmattn DMA default", (0, float("nan")))[1])
        elif name in res:  # the rows whose quality the CLI measured above
            res[name] = (ms, res[name][1])
    best = min(v[0] for k_, v in res.items() if k_.startswith("sdpa"))
    for name, (ms, err) in res.items():
        rows.append((N, name, ms, flops / ms / 1e9, best / ms, err))

# Shapes too large for the .npy route (N=65536) and the d=64 row: timing only, in-process binary.
def large_rows(N, d):
        q = torch.randn(B, HQ, N, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, HKV, N, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, HKV, N, d, device=dev, dtype=torch.bfloat16)
        flops = 2 * B * HQ * N * N * d
        res = {}
        for name, be in [("sdpa flash bf16", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn bf16", SDPBackend.CUDNN_ATTENTION)]:
            try:
                res[name] = (timeit(lambda: sdpa(q, k, v, be), iters=5), float("nan"))
            except Exception as e:
                print(f"{name} N={N} d={d}: unavailable ({str(e).splitlines()[0][:80]})")
        sage_rows(res, q, k, v)
        del q, k, v
        torch.cuda.empty_cache()
        for pol, ms in prefill_times(N, d, 3).items():
            res["dmattn " + pol.replace("-nocheck", " (unchecked)")] = (ms, float("nan"))
        sd = [v_[0] for k_, v_ in res.items() if k_.startswith("sdpa")]
        best = min(sd) if sd else float("nan")
        for name, (ms, err) in res.items():
            rows.append((N if d == 128 else f"{N}/d{d}", name, ms, flops / ms / 1e9, best / ms, err))



for N, d in [(65536, 128), (16384, 64)]:
    try:  # a failure here must not lose the rows measured above
        large_rows(N, d)
    except Exception as e:
        print(f"large-shape rows N={N} d={d} failed: {e}")

print(f"\nceilings, same run: bf16 matmul {bf16_peak:.0f} TFLOP/s, fp8 matmul {fp8_peak:.0f} TFLOP/s, copy {copy_gbs:.0f} GB/s")
print("| N | kernel | ms | TFLOP/s | vs best SDPA | % fp8 peak | rel. L2 vs fp32 |")
print("|---|---|---|---|---|---|---|")
for N, name, ms, tf, sp, err in rows:
    print(f"| {N} | {name} | {ms:.3f} | {tf:.1f} | {sp:.2f}x | {100 * tf / fp8_peak:.1f}% | {err:.3e} |")
