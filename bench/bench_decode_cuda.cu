// Decode step over an MX KV cache on the GPU (issue 6's benchmark, dmattn side): B sequences of
// `ctx` tokens, Hq=32, Hkv=8, d=128, one new query each, the default policy (the newest page in
// MXFP8 E4M3, every other page MXFP4; V bf16). The pages are filled on the device with random
// valid codes (the kernel's time does not depend on the values; building 64 x 128k tokens through
// the host cache would take minutes). Times decode_paged_async (q's quantization, the kernel, the
// split merge) with CUDA events, and the synchronous call (with its NaN check) on the wall clock.
// Bytes read = every page's K codes + scales + V, plus q and out. Ceilings, same run: a device copy
// (read + write bytes) and a read-only pass over 2 GiB.
// Prints one line per configuration: "dmattn-<pv> B ctx us_async us_sync GB/s bytes".
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/decode.cuh"

using namespace dmattn;
using dmattn::cuda::PagedKV;
using dmattn::cuda::decode_paged;
using dmattn::cuda::decode_paged_async;

#define CK(x)                                                          \
  do {                                                                 \
    cudaError_t e_ = (x);                                              \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));    \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

__device__ uint32_t mix(uint64_t i) {
  i ^= i >> 33;
  i *= 0xff51afd7ed558ccdull;
  i ^= i >> 33;
  return uint32_t(i);
}

// kind 0: K code bytes (E2M1 nibbles any, E4M3 bytes masked off NaN); 1: E8M0 scales near 2^0;
// 2: bf16 V in [-1, 1).
__global__ void fill(uint8_t* p, size_t n, int kind) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t r = mix(i * 3 + kind);
    if (kind == 0) p[i] = uint8_t(r & 0xF7);
    if (kind == 1) p[i] = uint8_t(122 + r % 8);
    if (kind == 2) reinterpret_cast<uint16_t*>(p)[i] = uint16_t((r & 0x8000) | (0x3C00 + (r >> 16) % 0x380));
  }
}

// Read-only ceiling: every byte of a buffer loaded once (16-byte loads), folded into one word per
// thread so the loads cannot be dropped. Decode only reads; a copy's figure counts reads and writes.
__global__ void read_all(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u) *sink = x;  // practically never taken
}

int main(int argc, char** argv) {
  const int Hq = 32, Hkv = 8, d = 128, T = 128;
  // usage: bench_decode_cuda [bf16|mxfp8|mxfp4 (V's format, pv)] [B] [ctx]
  const std::string pv_arg = argc > 1 ? argv[1] : "bf16";
  const bool pv8 = pv_arg == "mxfp8" || pv_arg == "mxfp4", pv4 = pv_arg == "mxfp4";  // pv8: V in MX codes
  std::vector<int> Bs = {1, 16, 64}, ctxs = {8192, 32768, 131072};
  if (argc > 2) Bs = {std::atoi(argv[2])};
  if (argc > 3) ctxs = {std::atoi(argv[3])};
  int maxB = 0, maxctx = 0;
  for (int b : Bs) maxB = std::max(maxB, b);
  for (int c : ctxs) maxctx = std::max(maxctx, c);
  const int64_t pages = int64_t(maxB) * (maxctx / T);
  const size_t code_bytes = size_t(Hkv) * T * d, scale_bytes = size_t(Hkv) * T * (d / 32), v_elems = size_t(Hkv) * T * d;
  uint8_t *codes, *scales, *slot, *v8 = nullptr, *vs = nullptr;
  uint16_t* v = nullptr;
  const size_t vs_bytes = size_t(Hkv) * (T / 32) * d;
  CK(cudaMalloc(&codes, pages * code_bytes));
  CK(cudaMalloc(&scales, pages * scale_bytes));
  CK(cudaMalloc(&slot, pages));
  fill<<<4096, 256>>>(codes, pages * code_bytes, 0);
  fill<<<4096, 256>>>(scales, pages * scale_bytes, 1);
  if (pv8) {  // V^T E4M3 codes (the K code rule keeps them off NaN) or E2M1 nibbles, and E8M0 block scales
    const size_t v8_bytes = pages * v_elems / (pv4 ? 2 : 1);
    CK(cudaMalloc(&v8, v8_bytes));
    CK(cudaMalloc(&vs, pages * vs_bytes));
    fill<<<4096, 256>>>(v8, v8_bytes, 0);
    fill<<<4096, 256>>>(vs, pages * vs_bytes, 1);
  } else {
    CK(cudaMalloc(&v, pages * v_elems * 2));
    fill<<<4096, 256>>>(reinterpret_cast<uint8_t*>(v), pages * v_elems, 2);
  }
  CK(cudaDeviceSynchronize());

  // Ceiling: device-to-device copy of 2 GiB, read + write bytes.
  {
    const size_t n = size_t(1) << 31;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
    cudaEventRecord(e0);
    for (int i = 0; i < 10; ++i) cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    std::printf("copy %.1f GB/s\n", 2.0 * n * 10 / (ms * 1e6));
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    read_all<<<sms * 8, 512>>>(static_cast<const uint4*>(a), n / 16, static_cast<uint32_t*>(b));
    cudaEventRecord(e0);
    for (int i = 0; i < 10; ++i) read_all<<<sms * 8, 512>>>(static_cast<const uint4*>(a), n / 16, static_cast<uint32_t*>(b));
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(&ms, e0, e1);
    std::printf("read %.1f GB/s\n", double(n) * 10 / (ms * 1e6));
    cudaFree(a);
    cudaFree(b);
  }

  Policy pol;  // default: mxfp8-e4m3 diag 1, mxfp4 elsewhere
  pol.pv = parse_pv(pv_arg);
  for (int B : Bs)
    for (int ctx : ctxs) {
      const int np = ctx / T;
      std::vector<int32_t> table(size_t(B) * np), length(size_t(B), ctx);
      std::vector<uint8_t> slots(size_t(pages), 1);
      double bytes = 0;
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < np; ++j) {
          const int32_t pid = b * np + j;
          table[size_t(pid)] = pid;
          const bool high = j == np - 1;  // the newest page: the diagonal tile
          slots[size_t(pid)] = high ? 0 : 1;
          bytes += double(Hkv) * T * ((high ? d : d / 2) + d / 32 + (pv4 ? d / 2 + d / 32 : pv8 ? d + d / 32 : 2 * d));
        }
      bytes += 2.0 * B * Hq * d * 2;  // q in, out
      int32_t *dtable, *dlen;
      CK(cudaMalloc(&dtable, table.size() * 4));
      CK(cudaMalloc(&dlen, length.size() * 4));
      CK(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dlen, length.data(), length.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(slot, slots.data(), slots.size(), cudaMemcpyHostToDevice));
      const PagedKV kv{codes, scales, v, slot, dtable, dlen, B, np, Hkv, d, v8, vs};
      void *q, *out;
      int* bad;
      CK(cudaMalloc(&q, size_t(B) * Hq * d * 2));
      CK(cudaMalloc(&out, size_t(B) * Hq * d * 2));
      CK(cudaMalloc(&bad, 4));
      CK(cudaMemset(bad, 0, 4));
      fill<<<64, 256>>>(static_cast<uint8_t*>(q), size_t(B) * Hq * d, 2);
      const TensorView tq = TensorView::contiguous(q, DType::bf16, {B, Hq, 1, d}, Device::cuda);
      const TensorView to = TensorView::contiguous(out, DType::bf16, {B, Hq, 1, d}, Device::cuda);
      const float scale = 0.08838835f;
      decode_paged_async(kv, pol, tq, to, nullptr, scale, 0, bad, nullptr);  // warm-up
      CK(cudaDeviceSynchronize());
      const int iters = ctx * B >= 16 * 131072 ? 10 : 50;
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventRecord(e0);
      for (int i = 0; i < iters; ++i) decode_paged_async(kv, pol, tq, to, nullptr, scale, 0, bad, nullptr);
      cudaEventRecord(e1);
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      const double us = 1e3 * ms / iters;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) decode_paged(kv, pol, tq, to, nullptr, scale, 0, nullptr);
      const double us_sync =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
      int bad_host = 0;
      CK(cudaMemcpy(&bad_host, bad, 4, cudaMemcpyDeviceToHost));
      if (bad_host) std::printf("warning: q flagged non-finite\n");
      std::printf("dmattn-%s %d %d %.2f %.2f %.1f %.0f\n", pv_arg.c_str(), B, ctx, us, us_sync, bytes / (us * 1e3), bytes);
      std::fflush(stdout);
      cudaFree(dtable);
      cudaFree(dlen);
      cudaFree(q);
      cudaFree(out);
      cudaFree(bad);
    }
  return 0;
}
