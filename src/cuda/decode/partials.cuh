// The decode's epilogue: a CTA's partial result for its split, [rows][d + 2] floats each (the
// unnormalised output, the row maximum m in raw score units, the row sum l), which merge.cuh combines.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/decode/smem.cuh"
#include "cuda/decode/softmax.cuh"

namespace dmattn::cuda::decode {

// Row i's partial of split `split`, the CTA's rows from q row qrow0 on (Params::part's layout).
template <int D>
__device__ __forceinline__ float* partial(const Params& p, int64_t qrow0, int i, int split) {
  return p.part + ((qrow0 + i) * p.splits + split) * (D + 2);
}

// A split with no pages of its sequence (more splits than pages): zeros, m = -inf (weight 0 in the merge).
template <int D>
__device__ __forceinline__ void write_empty_partial(const Params& p, int64_t qrow0, int rows, int split) {
  for (int i = threadIdx.x; i < rows * (D + 2); i += kThreads)
    partial<D>(p, qrow0, i / (D + 2), split)[i % (D + 2)] = i % (D + 2) == D ? -INFINITY : 0.0f;
}

// The warps' accumulators and row sums added (through the stage buffers, free once every copy was
// waited for) and written with the rows' maxima.
template <int D, int kVB, int kNR, int kCtas>
__device__ __forceinline__ void write_partial(const Params& p, uint8_t* smem, const float (&acc)[D / 16][kNR][4],
                                              const PageSoftmax<kNR>& sm, int64_t qrow0, int rows, int split) {
  using S_ = Smem<D, kVB, kNR, kCtas>;
  constexpr int MD = D / 16, kRows = S_::kRows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  auto out = [&](int i) { return partial<D>(p, qrow0, i, split); };
  __syncthreads();  // every copy was waited for and every warp is done with the stage buffers: they take the warps' accumulators
  float* sum = reinterpret_cast<float*>(smem);  // [kWarps][kRows][D]
  float* lsum = reinterpret_cast<float*>(smem + S_::kMax);  // [kWarps][kRows]: the maxima's buffers are free too
#pragma unroll
  for (int md = 0; md < MD; ++md)
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sum[(warp * kRows + 8 * nr + 2 * t + i % 2) * D + 16 * md + g + 8 * (i / 2)] = acc[md][nr][i];
  store_rows<kNR>(lsum + warp * kRows, sm.l, kSumOp);
  __syncthreads();
  for (int i = tid; i < rows * D; i += kThreads) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += sum[w * kRows * D + i];
    out(i / D)[i % D] = o;
  }
  if (warp == 0 && g == 0)  // m is the same in every warp and lane group
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 8 * nr + 2 * t + r;
        if (row >= rows) continue;
        float lr = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) lr += lsum[w * kRows + row];
        out(row)[D] = sm.m[nr][r];
        out(row)[D + 1] = lr;
      }
}

}  // namespace dmattn::cuda::decode
