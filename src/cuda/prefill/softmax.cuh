// The online softmax of one thread's two query rows (g and g + 8 of its warp's 16) over key tiles,
// in fp32 and base 2: m is the running maximum of logit * log2(e), l the running sum of
// exp2(logit * log2(e) - m). A quad of four threads shares a row; each holds a quarter of its keys.
#pragma once
#include <cmath>

#include "cuda/ptx/mma.cuh"

namespace dmattn::cuda::prefill {

constexpr float kLog2e = 1.4426950408889634f;

template <int kKeys>  // keys a tile: the thread holds kKeys / 2 scores (accumulator layout)
struct OnlineSoftmax {
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  // Takes a tile's masked scores s, where s * c[r] is row r's logit * log2(e) (c > 0, so the
  // maximum of s times c is the maximum), and leaves P = exp2(s * c - m + shift) in s: shift
  // scales P by 2^shift (pv = fp8 keeps P's E4M3 codes high in their range). alpha[r] is the factor
  // the row's running output takes for its new maximum.
  __device__ __forceinline__ void update(float (&s)[kKeys / 2], const float (&c)[2], float shift, float (&alpha)[2]) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], s[i]);
    float mref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float mnew = fmaxf(m[r], quad_max(mx[r]) * c[r]);
      // A row that has seen no key yet keeps its state (as if the tile were skipped).
      alpha[r] = mnew == -INFINITY ? 1.0f : exp2_approx(m[r] - mnew);
      mref[r] = mnew == -INFINITY ? 0.0f : mnew - shift;
      m[r] = mnew;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) {
      s[i] = exp2_approx(fmaf(s[i], c[(i / 2) % 2], -mref[(i / 2) % 2]));  // one rounding: exact near the max
      l[(i / 2) % 2] += s[i];
    }
  }

  // Row r's sum over its quad (every thread of the quad gets it).
  __device__ __forceinline__ float row_sum(int r) const { return quad_sum(l[r]); }

  // Row r's log-sum-exp of logits from its quad sum lr (shift as in update); -inf for a row that saw no key.
  __device__ __forceinline__ float lse(int r, float lr, float shift) const {
    return lr > 0.0f ? m[r] / kLog2e + (logf(lr) - shift * 0.69314718f) : -INFINITY;
  }
};

}  // namespace dmattn::cuda::prefill
