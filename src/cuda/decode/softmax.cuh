// The decode's online softmax over pages, in base 2 on the SFU. Each warp holds S^T of its 32 keys of a
// page for the CTA's rows (s[mt][nr][i]: key 16mt + g + 8(i/2), row 8nr + 2t + i%2); the warps agree on
// each row's maximum over the whole page through shared memory (the page's one CTA barrier), as the
// oracle's softmax takes a page's maximum, so every warp rescales by the same factors and their
// accumulators and sums add up at the end.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/decode/params.cuh"
#include "cuda/ptx/mma.cuh"

namespace dmattn::cuda::decode {

// x reduced by op over the 8 lanes of the same t (an accumulator column's rows g).
template <class Op>
__device__ __forceinline__ float over_g(float x, Op op) {
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// Per-row values (rows 8nr + 2t + r of S^T's columns) reduced over g and stored, a float a row.
template <int kNR, class Op>
__device__ __forceinline__ void store_rows(float* dst, const float (&v)[kNR][2], Op op) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float x = over_g(v[nr][r], op);
      if (g == 0) dst[8 * nr + 2 * t + r] = x;
    }
}
constexpr auto kMaxOp = [](float a, float b) { return fmaxf(a, b); };
constexpr auto kSumOp = [](float a, float b) { return a + b; };

// Row state m (the running maximum of raw scores) and l (this lane's share of the row sum).
template <int kNR>
struct PageSoftmax {
  float m[kNR][2], l[kNR][2];

  __device__ __forceinline__ PageSoftmax() {
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr) m[nr][0] = m[nr][1] = -INFINITY, l[nr][0] = l[nr][1] = 0.0f;
  }

  // Takes page j's masked raw scores s (mask.cuh) and leaves P = 2^((s - m) scale) in s; red: two
  // buffers of [kWarps][rows] floats (a warp runs at most a page ahead). alpha: the factor each row's
  // accumulator takes for its new maximum. Returns whether any lane's alpha differs from 1.
  __device__ __forceinline__ bool update(float (&s)[2][kNR][4], float* red, int j, float scale, float (&alpha)[kNR][2]) {
    constexpr int kRows = 8 * kNR;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, t = lane % 4;
    float mx[kNR][2];  // the rows' maxima over this warp's raw scores (scale > 0: applied to s - m below)
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr) {
      mx[nr][0] = mx[nr][1] = -INFINITY;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) mx[nr][i % 2] = fmaxf(mx[nr][i % 2], s[mt][nr][i]);
    }
    red += (j & 1) * kWarps * kRows;
    store_rows<kNR>(red + warp * kRows, mx, kMaxOp);
    __syncthreads();
    float mref[kNR][2];
    bool rescale = false;
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 8 * nr + 2 * t + r;
        float pm = red[row];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) pm = fmaxf(pm, red[w * kRows + row]);
        const float mnew = fmaxf(m[nr][r], pm);
        // A row that has seen no key yet keeps its state (as if the page were skipped).
        alpha[nr][r] = mnew == -INFINITY ? 1.0f : exp2_approx((m[nr][r] - mnew) * scale);
        mref[nr][r] = mnew == -INFINITY ? 0.0f : mnew;
        m[nr][r] = mnew;
        l[nr][r] *= alpha[nr][r];
        rescale |= alpha[nr][r] != 1.0f;
      }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // Base 2 on the SFU: FADD, FMUL and a MUFU, where expf took ~9 instructions. The scale (with
          // log2 e) multiplies s - m, not s: scaling s first rounds each logit at its own magnitude, an
          // error of |logit| x 2^-24 in the exponent that the difference then keeps (4e-5 rel. L2 against
          // the oracle at d = 64, whose scale 1/8 is exact on the CPU); s - m is exact near the maximum,
          // where P matters. masked: -inf x scale = -inf, 2^-inf = 0.
          s[mt][nr][i] = exp2_approx((s[mt][nr][i] - mref[nr][i % 2]) * scale);
          l[nr][i % 2] += s[mt][nr][i];
        }
    return __any_sync(0xffffffffu, rescale);
  }
};

}  // namespace dmattn::cuda::decode
