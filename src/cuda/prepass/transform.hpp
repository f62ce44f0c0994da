// The accuracy transforms' pre-pass on the GPU (Policy::rotate, smooth_k, smooth_q, sink_keys; their
// semantics in include/dmattn/attention.hpp): Q and K rotated and smoothed into bf16 rows, which the
// quantize pass then takes as its input, plus what the prefill kernel and its epilogue need besides.
#pragma once
#include <cuda_runtime.h>

#include "cuda/prefill/packing.hpp"
#include "problem.hpp"

namespace dmattn::cuda {

// Outputs, all device memory of the caller (sizes from Problem p, qtiles = the query tiles the
// call's rows touch, ldv = Nk rounded up to 128).
struct Transformed {
  uint16_t* q = nullptr;     // [B, Hq, Nq, d] bf16 bits: rotated, minus the head's mean (smooth_q)
  uint16_t* q_plain = nullptr;  // smooth_q=high: [B, Hq, Nq, d] rotated, not centred (the low tiles')
  uint16_t* k = nullptr;     // [B, Hkv, Nk, d] bf16 bits: rotated, minus the key mean (smooth_k)
  double* k_part = nullptr;  // smooth_k: [B*Hkv, ceil(Nk/128), d] scratch (partial channel sums)
  float* kmean = nullptr;    // smooth_k: [B*Hkv, d]
  double* q_part = nullptr;  // smooth_q: [B*Hq, ceil(Nq/128), d] scratch (partial channel sums)
  float* qmean = nullptr;    // smooth_q: [B*Hq, d]
  float* ds = nullptr;       // smooth_q: [B*Hq, ldv], mu.k' times the softmax scale (logits), 0 past Nk
  float* lse_shift = nullptr;  // smooth_k with an LSE: [B*Hq*Nq], scale * q_rot.kmean
  float* sink = nullptr;     // sink_keys: [B*Hq*Nq, sink] exact scores times the softmax scale
  int sink_keys = 0;         // keys scored exactly (sink_keys less the key offset, at most Nk)
  int64_t qtile0 = 0, qtiles = 0;  // the first query tile (from key 0) and how many the rows touch
};

// Query tiles touched by the rows of p, counted from key 0's position.
void query_tiles(const Problem& p, int64_t& first, int64_t& count);

// Fills t (its buffers allocated by the caller for the transforms p.policy turns on), on `stream`.
// `scale` is the softmax scale the kernel applies (rotation's block size already divided out).
void transform_qk(const Problem& p, const Transformed& t, float scale, cudaStream_t stream);

// The fast path's pieces (rotation and the means applied by the quantize pass as it reads the rows,
// quantize.hpp's RowTransform): smooth_k's key means and smooth_q's query means (part: [B*H][chunks][d]
// scratch), smooth_q's correction ds (Transformed::ds) from the keys as transformed, and the LSE
// shifts scale * q_rot.kmean of every query row.
// Packed sequences (pk; p's K the packed [1, Hkv, total_k, d]): each sequence's key means, kmean
// [nseq * Hkv][d], part [Hkv][ldv / 128][d]; lse_shifts then takes each query row's sequence (row_seq).
void key_means(const Problem& p, double* part, float* kmean, cudaStream_t stream, const PackedMaps* pk = nullptr);
void query_means(const Problem& p, double* part, float* qmean, cudaStream_t stream);
void key_dots(const Problem& p, const float* kmean, const float* qmean, float scale, float* ds, cudaStream_t stream);
void lse_shifts(const Problem& p, const float* kmean, float scale, int64_t qtile0, int64_t qtiles, float* shift,
                cudaStream_t stream, const int32_t* row_seq = nullptr);

// lse[i] += shift[i] for the n rows (smooth_k's correction, after the prefill wrote lse).
void add_lse_shift(float* lse, const float* shift, int64_t n, cudaStream_t stream);

}  // namespace dmattn::cuda
