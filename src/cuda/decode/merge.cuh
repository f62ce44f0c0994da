// The decode's second kernel: the splits' partials (partials.cuh) merged by LSE into the output.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/ptx/pdl.cuh"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda::decode {

// One warp per (row, 32 columns): the splits merged by LSE in one pass over their maxima (the CPU
// oracle folds them pairwise; the two agree to fp32 rounding). Lanes first take the splits' (m, l)
// for the weights, then a column each, its loads over the splits independent of each other (an
// empty split is zeros with m = -inf, weight 0), so they are in flight together.
template <class TOut>
__global__ void merge_splits(const float* part, int64_t rows, int splits, int d, TOut* out, int64_t osb, int64_t osh,
                             int64_t osn, int Hq, int Nq, float scale, float* lse, const float* lse_shift) {
  wait_prior_grids();  // the decode kernel's partials are complete and visible
  const int64_t wid = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32, row = wid / (d / 32);
  const int lane = threadIdx.x % 32, c = int(wid % (d / 32)) * 32 + lane;
  if (row >= rows) return;
  const float* pr = part + row * splits * (d + 2);
  float M = -INFINITY;
  for (int sp = lane; sp < splits; sp += 32) M = fmaxf(M, pr[sp * (d + 2) + d]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  auto weight = [&](int sp) {  // exp(scale (m - M)) of split sp (0 for an empty one; m: raw scores)
    const float m = pr[sp * (d + 2) + d];
    return m == -INFINITY ? 0.0f : expf((m - M) * scale);
  };
  const float w_lane = lane < splits ? weight(lane) : 0.0f;  // the first 32 splits' weights, a lane each
  float lsum = 0.0f;
  for (int sp = lane; sp < splits; sp += 32) lsum += pr[sp * (d + 2) + d + 1] * (sp < 32 ? w_lane : weight(sp));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
  float o = 0.0f;
#pragma unroll 16
  for (int sp = 0; sp < splits; ++sp) o += pr[sp * (d + 2) + c] * (sp < 32 ? __shfl_sync(0xffffffffu, w_lane, sp) : weight(sp));
  const int64_t s = row / (int64_t(Hq) * Nq), h = row / Nq % Hq, r = row % Nq;
  out[s * osb + h * osh + r * osn + c] = from_float<TOut>(o / lsum);
  if (lse && c == 0) lse[row] = M * scale + logf(lsum) + (lse_shift ? lse_shift[row] : 0.0f);  // M in raw score units
}

}  // namespace dmattn::cuda::decode
