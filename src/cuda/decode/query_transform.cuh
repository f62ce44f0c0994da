// The decode's query pre-pass for the accuracy transforms (QueryTransform, decode.cuh).
#pragma once
#include <cstdint>

#include "cuda/common/rotate_lanes.cuh"
#include "cuda/decode/decode.cuh"
#include "cuda/ptx/pdl.cuh"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda::decode {

// The query side of the transforms (QueryTransform), a warp per row, lane l holding channels
// E*l .. E*l + E - 1 (E = D/32): the row rotated in fp32 (rotate_lanes: rotate_row's values), stored
// rounded to bf16 for the decode kernel's quantization; from the rotated fp32 row, the sink keys'
// exact scores and smooth_k's LSE shift, products and sums in fp64 (one rounding to fp32 at the end).
template <int D, class TIn>
__global__ void transform_queries(const TIn* q, int64_t qsb, int64_t qsh, int64_t qsn, int Hq, int Nq, int G,
                                  int64_t rows, QueryTransform qt, PagedKV kv, float scale, uint16_t* qout, float* sink,
                                  float* shift) {
  constexpr int E = D / 32;
  allow_dependents();  // the decode kernel may start its page copies
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t s = row / (int64_t(Hq) * Nq), h = row / Nq % Hq, r = row % Nq, hk = h / G;
  const TIn* src = q + s * qsb + h * qsh + r * qsn + E * lane;
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = to_float(src[e]);
  if (qt.rotate) rotate_lanes(x);
#pragma unroll
  for (int e = 0; e < E; ++e) qout[row * D + E * lane + e] = to_bf16(x[e]).bits;
  // This sequence's state: its first page's, head hk's rows.
  const float* st = qt.state + (int64_t(kv.row(s)[0]) * kv.Hkv + hk) * qt.rows * D;
  auto dot = [&](const float* k) {
    double acc = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) acc += double(x[e]) * k[E * lane + e];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return float(acc);
  };
  if (qt.smooth_k) {
    const float v = dot(st) * scale;
    if (lane == 0) shift[row] = v;
  }
  const float* sk = st + (qt.smooth_k ? D : 0);
  for (int n = 0; n < qt.sink_keys; ++n) {
    const float v = dot(sk + n * D);
    if (lane == 0) sink[row * qt.sink_keys + n] = v;
  }
}

}  // namespace dmattn::cuda::decode
