// The tensor-core rate of the prefill kernel's own wgmma shapes, issued the way it issues them: one
// or two warpgroups a CTA, one CTA an SM on every SM, each warpgroup repeating a chain of `len`
// wgmmas (fence, chain, commit, wait). Prints cycles a wgmma (clock64 around the rounds, per
// warpgroup) and TFLOP/s over the grid (events). The ceiling a kernel that serialises its
// warpgroups' chains (the prefill's ping-pong) can reach, against the dense matmul ceiling that
// compare_sdpa.py measures through torch.
// Usage: bench_wgmma_cuda [rounds]   (default 2048, ~1 ms a launch; 200000 holds the load long enough
// for the power limit to show)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cuda/ptx/wgmma.cuh"
#include "sm_bench.cuh"

using namespace dmattn::cuda;

namespace {

enum class Op { ss_fp8, rs_fp8, rs_bf16 };

// A [64 x K] at smem, B [N x K] after it, 128-byte swizzled K-major tiles, of pseudo-random finite
// values (the rate depends on them: zeros run at the full clock, random data throttles it).
template <Op kOp, int N, int kLen>
__global__ void __launch_bounds__(256, 1) rate_kernel(int warpgroups, int rounds, long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  auto bits = [](uint32_t i) {  // a hash; & 0x3B3B3B3B keeps E4M3 codes (and bf16 pairs) finite and small
    i = (i ^ 61u) ^ (i >> 16);
    i *= 9u;
    i ^= i >> 4;
    i *= 0x27d4eb2du;
    return (i ^ (i >> 15)) & 0x3B3B3B3Bu;
  };
  for (int i = threadIdx.x; i < 64 * 1024 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = bits(uint32_t(i));
  wg::fence_async_smem();
  __syncthreads();
  const int wgi = threadIdx.x / 128;
  if (wgi >= warpgroups) return;
  const wg::Desc a = wg::make_desc<128>(smem), b = wg::make_desc<128>(smem + 16384);
  float d[N / 2];
  uint32_t ra[4] = {bits(threadIdx.x + 100000u), bits(threadIdx.x + 200000u), bits(threadIdx.x + 300000u),
                    bits(threadIdx.x + 400000u)};
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
  const long long t0 = clock64();
  for (int r = 0; r < rounds; ++r) {
    wg::fence();
#pragma unroll
    for (int c = 0; c < kLen; ++c) {
      if constexpr (kOp == Op::ss_fp8)
        wg::mma_fp8<N, false>(d, (a + (c % 4) * 32).u64(), (b + (c % 4) * 32).u64(), true);
      else if constexpr (kOp == Op::rs_fp8)
        wg::mma_fp8_rs<N, true>(d, ra, (b + (c % 4) * 32).u64());
      else
        wg::mma_bf16_rs<N>(d, ra, (b + (c % 4) * 32).u64());
    }
    wg::commit();
    wg::wait<0>();
    wg::pin(d);
  }
  const long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) sum += d[i];
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + wgi] = (t1 - t0) + (sum == 1.0f ? 1 : 0);
}

template <Op kOp, int N, int kLen>
void run(const char* name, int warpgroups, int rounds, SmBench& sb) {
  constexpr auto kernel = rate_kernel<kOp, N, kLen>;
  constexpr int bytes = 64 * 1024;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  const float ms = sb.time_ms([&] { kernel<<<sb.sms, 256, bytes>>>(warpgroups, rounds, sb.cycles); });
  const std::vector<long long> h = sb.read();
  double cyc = 0.0;
  for (int s = 0; s < sb.sms; ++s)
    for (int w = 0; w < warpgroups; ++w) cyc += double(h[size_t(s) * sb.slots + w]);
  cyc /= double(sb.sms * warpgroups);
  const double k = kOp == Op::rs_bf16 ? 16.0 : 32.0;
  const double flops = 2.0 * 64 * N * k * kLen * rounds * warpgroups * sb.sms;
  const double per = cyc / (double(kLen) * rounds);  // cycles a wgmma, seen by one warpgroup
  std::printf("%-28s wgs %d len %2d: %6.1f cycles a wgmma (%6.1f a wgmma of the SM), %7.1f TFLOP/s, %.1f GHz\n", name,
              warpgroups, kLen, per, per / warpgroups, flops / (ms * 1e-3) / 1e12, cyc / (ms * 1e-3) / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2048;
  SmBench sb;
  if (!sb.init(2)) return 1;
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<Op::ss_fp8, 128, 4>("SS e4m3 m64n128k32 (S)", wgs, rounds, sb);
    run<Op::ss_fp8, 128, 16>("SS e4m3 m64n128k32", wgs, rounds, sb);
    run<Op::ss_fp8, 64, 4>("SS e4m3 m64n64k32", wgs, rounds, sb);
    run<Op::rs_fp8, 128, 4>("RS e4m3 m64n128k32 (P.V)", wgs, rounds, sb);
    run<Op::rs_fp8, 64, 4>("RS e4m3 m64n64k32", wgs, rounds, sb);
    run<Op::rs_bf16, 128, 8>("RS bf16 m64n128k16 (P.V)", wgs, rounds, sb);
  }
  return SmBench::status();
}
