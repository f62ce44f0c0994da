// How many softmax chains an SM wants: a model of the prefill's consumer loop (d = 128 or 64, bf16 P.V)
// without its producer, masks, scales and loop head. W warpgroups of 64 query rows each walk key
// tiles of BK keys (128 as the prefill does, or 64: the halves a third warpgroup's registers need at
// d = 128). A tile: [turn] S_j (FP8 wgmma chain over d) and P_{j-1}.V_{j-1} issued, [hand-over], S_j
// waited, online softmax (the prefill's own OnlineSoftmax), P.V waited (o rescaled where a maximum rose), P_j
// packed to bf16. Prints SM cycles per 128 x 128 tile pair of work (two 64-row warpgroups x 128
// keys), to set against the tensor work of a pair at d = 128 (1,536 cycles: bench_wgmma_cuda) and the
// prefill's period (2,650 at N = 16384 by ncu; bench/RESULTS.md, has both).
// Usage: bench_chains_cuda [tiles]   (default 4096 tiles of 128 keys a warpgroup)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/prefill/softmax.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "sm_bench.cuh"

using namespace dmattn::cuda;

namespace {

constexpr int kQ = 0, kK = 8192, kV = 24576, kSmem = kV + 2 * 16384;  // Q [64][128 B], K [128][128 B], V^T 2 x [128][64 keys]

template <int W, int BK, bool kTurns, int D>
__global__ void __launch_bounds__(128 * W, 1) chains_kernel(int tiles, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < kSmem / 4; i += blockDim.x) {  // finite pseudo-random E4M3 codes and bf16 pairs
    uint32_t x = uint32_t(i) * 0x9E3779B9u;
    x ^= x >> 15;
    reinterpret_cast<uint32_t*>(smem)[i] = (x * 0x2C1B3C6Du) & 0x3B3B3B3Bu;
  }
  wg::fence_async_smem();
  __syncthreads();
  const int wgi = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const wg::Desc dq = wg::make_desc<128>(smem + kQ), dk = wg::make_desc<128>(smem + kK), dv = wg::make_desc<128>(smem + kV);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  prefill::OnlineSoftmax<BK> softmax;  // the prefill's own piece
  const float row_factor[2] = {0.1275f, 0.1275f};  // each row's factor from S to logit * log2(e)
  uint32_t a[BK / 16][4];
#pragma unroll
  for (int kc = 0; kc < BK / 16; ++kc) a[kc][0] = a[kc][1] = a[kc][2] = a[kc][3] = 0u;
  const int me = 1 + wgi, next = 1 + (wgi + 1) % W;
  if (kTurns && wgi == W - 1) wg::bar_arrive(1, 256);
  const int n = tiles * (128 / BK);
  const long long t0 = clock64();
  for (int j = 0; j < n; ++j) {
    float s[BK / 2];
    if (kTurns) wg::bar_sync(me, 256);
    wg::fence();
#pragma unroll
    for (int c = 0; c < D / 32; ++c) wg::mma_fp8<BK, false>(s, (dq + c * 32).u64(), (dk + c * 32).u64(), c > 0);
    wg::commit();
#pragma unroll
    for (int kc = 0; kc < BK / 16; ++kc) {  // BK = 64: one V^T half a tile, by turns
      const int h = BK == 128 ? kc / 4 : j % 2;
      wg::mma_bf16_rs<D>(o, a[kc], (dv + (h * 16384 + (kc % 4) * 32)).u64());
    }
    wg::commit();
    if (kTurns && (wgi != W - 1 || j + 1 < n)) wg::bar_arrive(next, 256);
    wg::wait<1>();
    wg::pin(s);
    float alpha[2];
    softmax.update(s, row_factor, 0.0f, alpha);
    wg::wait<0>();
    wg::pin(o);
    wg::pin(a);
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i / 2) % 2];
#pragma unroll
    for (int kc = 0; kc < BK / 16; ++kc) {
      a[kc][0] = bf16x2_rn(s[8 * kc], s[8 * kc + 1]);
      a[kc][1] = bf16x2_rn(s[8 * kc + 2], s[8 * kc + 3]);
      a[kc][2] = bf16x2_rn(s[8 * kc + 4], s[8 * kc + 5]);
      a[kc][3] = bf16x2_rn(s[8 * kc + 6], s[8 * kc + 7]);
    }
  }
  const long long t1 = clock64();
  float sum = softmax.l[0] + softmax.l[1];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) sum += o[i];
  if (sum == 1.2345f) sink[threadIdx.x] = sum;  // keeps the work
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 4 + wgi] = t1 - t0;
}

template <int W, int BK, bool kTurns, int D = 128>
void run(int tiles, SmBench& sb, float* sink) {
  constexpr auto kernel = chains_kernel<W, BK, kTurns, D>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  const float ms = sb.time_ms([&] { kernel<<<sb.sms, 128 * W, kSmem>>>(tiles, sb.cycles, sink); });
  const std::vector<long long> h = sb.read();
  double cyc = 0.0;  // the slowest warpgroup an SM, averaged over the SMs
  for (int s = 0; s < sb.sms; ++s) {
    long long mx = 0;
    for (int w = 0; w < W; ++w) mx = std::max(mx, h[size_t(s) * sb.slots + w]);
    cyc += double(mx) / sb.sms;
  }
  const double pairs = double(W) * 64 * 128 * tiles / (128.0 * 128);  // 128 x 128 tile pairs an SM
  const double flops = 4.0 * 64 * 128 * D * tiles * W * sb.sms;       // S and P.V
  std::printf("d=%3d, %d warpgroups, %3d-key tiles, %-8s: %6.0f SM cycles a tile pair, %6.1f TFLOP/s, %.2f GHz\n", D,
              W, BK, kTurns ? "turns" : "no turns", cyc / pairs, flops / (ms * 1e-3) / 1e12, cyc / (ms * 1e-3) / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 4096;
  SmBench sb;
  float* sink = nullptr;
  if (!sb.init(4) || cudaMalloc(&sink, sizeof(float) * 512) != cudaSuccess) return 1;
  run<2, 128, true>(tiles, sb, sink);  // the prefill's shape
  run<2, 128, false>(tiles, sb, sink);
  run<2, 64, true>(tiles, sb, sink);   // the cost of halves alone
  run<2, 64, false>(tiles, sb, sink);
  run<3, 64, true>(tiles, sb, sink);   // a third chain
  run<3, 64, false>(tiles, sb, sink);
  run<2, 128, true, 64>(tiles, sb, sink);  // d = 64: the prefill's shape (turns at d = 128 only)
  run<2, 128, false, 64>(tiles, sb, sink);
  run<3, 128, false, 64>(tiles, sb, sink);  // d = 64 fits a third chain without halves
  run<3, 64, false, 64>(tiles, sb, sink);
  return SmBench::status();
}
