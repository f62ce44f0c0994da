// The prefill's epilogue: a consumer thread's two rows of O / l (times V's channel scales for
// pv = fp8) written in the output's dtype, and each row's log-sum-exp.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/prefill/params.cuh"
#include "cuda/prefill/smem.cuh"
#include "cuda/prefill/softmax.cuh"
#include "cuda/ptx/mma.cuh"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda::prefill {

// Two adjacent output elements (lo at dst[0]) rounded to nearest-even in one conversion and one store;
// dst must be aligned to the pair.
__device__ __forceinline__ void store_pair(float* dst, float lo, float hi) { *reinterpret_cast<float2*>(dst) = make_float2(lo, hi); }
__device__ __forceinline__ void store_pair(bf16* dst, float lo, float hi) { *reinterpret_cast<uint32_t*>(dst) = bf16x2_rn(lo, hi); }
__device__ __forceinline__ void store_pair(fp16* dst, float lo, float hi) { *reinterpret_cast<uint32_t*>(dst) = f16x2_rn(lo, hi); }

// o: the thread's accumulator after the last tile; rows g and g + 8 of its warp at output rows
// row[0], row[1] (valid: inside the output); hk: the head's KV head (V's scales).
template <int D, class TOut, bool kF8V>
__device__ __forceinline__ void store_output(const PrefillParams& p, const float (&o)[D / 2],
                                             const OnlineSoftmax<Tiling<D>::kBN>& softmax, int b, int h, int hk,
                                             const int64_t (&row)[2], const bool (&valid)[2], int t) {
  constexpr float kShift = kF8V ? float(kPvFp8Shift) : 0.0f;
  // pv = fp8: V's scales for this thread's D/4 columns (acc_col), all loaded before any store: read
  // next to the stores, which may alias them, each load's latency stalled its store (8% of the
  // kernel's samples at N = 8192, ncu).
  float vs[kF8V ? D / 4 : 1];
  if constexpr (kF8V) {
    const float* vsrc = p.vscale + (int64_t(b) * p.Hkv + hk) * D;
#pragma unroll
    for (int k = 0; k < D / 4; ++k) vs[k] = vsrc[acc_col(k / 2 * 4 + k % 2, t)];
  }
  // out = O / l, lse = m + log l; rows that saw no key write zeros and -inf. One reciprocal a row
  // (a division an element was ~8 instructions with a slow-path branch; the products differ from
  // the quotients by an ulp of fp32) and, where aligned, columns 2t and 2t+1 as one store.
  auto out_value = [&](int i, int k) {  // register i of O, with V's channel scale k (pv = fp8)
    if constexpr (kF8V)
      return o[i] * vs[k];
    else
      return o[i];
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lr = softmax.row_sum(r);
    if (!valid[r]) continue;
    const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
    TOut* orow = static_cast<TOut*>(p.out) + b * p.out_sb + h * p.out_sh + row[r] * p.out_sn;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int i = 4 * n + 2 * r;  // registers i, i + 1: columns 8n + 2t, + 1 of row half r
      const float x0 = out_value(i, 2 * n) * inv, x1 = out_value(i + 1, 2 * n + 1) * inv;
      if (p.out_pairs) {
        store_pair(orow + acc_col(i, t), x0, x1);
      } else {
        orow[acc_col(i, t)] = from_float<TOut>(x0);
        orow[acc_col(i, t) + 1] = from_float<TOut>(x1);
      }
    }
    if (p.lse && t == 0)
      p.lse[(int64_t(b) * p.Hq + h) * p.Nq + row[r]] = softmax.lse(r, lr, kShift);
  }
}

}  // namespace dmattn::cuda::prefill
