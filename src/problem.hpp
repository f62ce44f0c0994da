// A validated attention problem, as every backend sees it.
#pragma once
#include <algorithm>

#include <vector>

#include "dmattn/attention.hpp"

namespace dmattn {

class KVCache;

struct Problem {
  TensorView q, k, v, out;
  float* lse = nullptr;
  int64_t B = 0, Hq = 0, Hkv = 0, Nq = 0, Nk = 0, d = 0;
  float scale = 1.0f;
  bool causal = false;
  Policy policy{};
  int threads = 0;
  void* stream = nullptr;  // cudaStream_t for the CUDA backend
  bool check_finite = true;  // throw on NaN/Inf inputs (CUDA: reads flags back, a host sync)
  int64_t q_pos0 = 0, k_pos0 = 0;  // absolute positions of query row 0 and key 0 (k_pos0 % 128 == 0)
  int64_t window_left = -1, window_right = -1;  // sliding window; -1: unbounded

  int64_t group() const { return Hq / Hkv; }
  int64_t position(int64_t r) const { return q_pos0 + r; }  // default q_pos0 = Nk - Nq: bottom-right
  // The mask, stated once: row r sees the local keys [key_begin(r), key_end(r)) (causal and the
  // sliding window; key_begin <= key_end).
  int64_t key_end(int64_t r) const {
    int64_t end = causal ? position(r) + 1 - k_pos0 : Nk;
    if (window_right >= 0) end = std::min(end, position(r) + window_right + 1 - k_pos0);
    return std::clamp<int64_t>(end, 0, Nk);
  }
  int64_t key_begin(int64_t r) const {
    return window_left < 0 ? 0 : std::clamp<int64_t>(position(r) - window_left - k_pos0, 0, key_end(r));
  }
  int64_t key_tile0() const { return k_pos0 / kTile; }  // absolute tile of local key tile 0
  // Absolute query tile of row r (floor division: positions can be negative when Nq > Nk).
  int64_t query_tile(int64_t r) const { return hd::floor_div(position(r), kTile); }
  float* lse_at(int64_t b, int64_t h, int64_t r) const { return lse ? lse + (b * Hq + h) * Nq + r : nullptr; }
};

// Checks an attention call's arguments (shapes, dtypes, policy, scale) and describes it.
Problem validate(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out, float* lse,
                 const AttentionOptions& o);

namespace cpu {
void exact_attention(const Problem& p);  // fp64 reference
void dma_attention(const Problem& p);    // DMA, docs/DESIGN.md
}  // namespace cpu

namespace cuda {
// Decode over the cache's pages, mirrored on the device (KVCache::device_state); q, out and lse on
// the device; splits 0 = automatic. Ordered on `stream`; returns when the results are written.
void decode_attention(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                      float* lse, float scale, int splits, void* stream);
void dma_attention(const Problem& p);  // all tensors on the current CUDA device; ordered on p.stream
}  // namespace cuda

}  // namespace dmattn
