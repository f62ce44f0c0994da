// O += P.V for one key tile: P packed from the softmax's registers into wgmma A fragments (bf16, or
// E4M3 for pv = fp8) and the chain over the tile's V^T in shared memory.
#pragma once
#include "cuda/prefill/smem.cuh"
#include "cuda/ptx/fp8.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace dmattn::cuda::prefill {

// O += bf16(P) . V over one step's keys, 16 keys per wgmma; P's accumulator layout is the A-fragment
// layout. svt: the stage's V^T descriptor. Issued; the caller commits and awaits it. At d = 256, O is
// two m64n128 accumulators of 128 channels each (V^T rows 0-127 and 128-255), whose registers read
// like one m64n256's (acc_col).
template <int D, int BN = Tiling<D>::kBN>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&a)[BN / 16][4], wg::Desc svt) {
  wg::fence();  // as in issue_chain
#pragma unroll
  for (int kc = 0; kc < BN / 16; ++kc) {
    const wg::Desc v = svt + ((kc / 4) * Smem<D, false>::kVHalf + (kc % 4) * 32);
    if constexpr (D <= 128) {
      wg::mma_bf16_rs<D>(o, a[kc], v.u64());
    } else {
#pragma unroll
      for (int n = 0; n < D / 128; ++n)
        wg::mma_bf16_rs<128>(*reinterpret_cast<float(*)[64]>(o + 64 * n), a[kc], (v + n * 128 * 128).u64());
    }
  }
}

// pv = fp8: o = P.V over one key tile into a fresh accumulator, 32 keys per wgmma (E4M3 P in the
// A-fragment order pv_fp8_key, V^T's keys stored in the same order). A fresh accumulator a tile,
// added to the running output in fp32 by the caller: Hopper's FP8 wgmma keeps about 13 bits of its
// sums (GpuMma.WgmmaFp8DotPrecision), too few for a running sum over thousands of keys.
template <int D, int BN = Tiling<D>::kBN>
__device__ __forceinline__ void issue_pv_fp8(float (&o)[D / 2], const uint32_t (&a)[BN / 32][4], wg::Desc svt) {
  wg::fence();
  wg::mma_fp8_rs<D, false>(o, a[0], svt.u64());
#pragma unroll
  for (int kc = 1; kc < BN / 32; ++kc) wg::mma_fp8_rs<D, true>(o, a[kc], (svt + kc * 32).u64());
}

// P's A fragments (the accumulator layout, acc_col) as bf16, or as E4M3 (kF8V; P already carries
// 2^kPvFp8Shift) in pv_fp8_key order: a[kc] = rows g, g+8 at logical keys 4t.., then 16+4t...
template <bool kF8V, int kScores>  // kScores = BN / 2, a thread's scores of a step
__device__ __forceinline__ void pack_p(const float (&s)[kScores], uint32_t (&a)[kF8V ? kScores / 16 : kScores / 8][4]) {
  constexpr int BN = 2 * kScores;
  if constexpr (kF8V) {
#pragma unroll
    for (int kc = 0; kc < BN / 32; ++kc) {
      const float* q = s + 16 * kc;  // columns 32kc..32kc+31: q[4n + e] is column 8n + 2t + e%2 of row half e/2
      a[kc][0] = fp8x2_encode<false>(q[0], q[1]) | uint32_t(fp8x2_encode<false>(q[4], q[5])) << 16;
      a[kc][1] = fp8x2_encode<false>(q[2], q[3]) | uint32_t(fp8x2_encode<false>(q[6], q[7])) << 16;
      a[kc][2] = fp8x2_encode<false>(q[8], q[9]) | uint32_t(fp8x2_encode<false>(q[12], q[13])) << 16;
      a[kc][3] = fp8x2_encode<false>(q[10], q[11]) | uint32_t(fp8x2_encode<false>(q[14], q[15])) << 16;
    }
  } else {
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      const float* q0 = s + 8 * kc;  // registers of columns 16kc..16kc+7 (4) and 16kc+8.. (4)
      a[kc][0] = bf16x2_rn(q0[0], q0[1]);
      a[kc][1] = bf16x2_rn(q0[2], q0[3]);
      a[kc][2] = bf16x2_rn(q0[4], q0[5]);
      a[kc][3] = bf16x2_rn(q0[6], q0[7]);
    }
  }
}

}  // namespace dmattn::cuda::prefill
