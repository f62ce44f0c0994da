// A validated attention problem, as every backend sees it.
#pragma once
#include <algorithm>

#include <vector>

#include "core/mask.hpp"
#include "dmattn/attention.hpp"

namespace dmattn {

class KVCache;
struct DecodeOptions;

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
  // Row r sees the local keys [key_begin(r), key_end(r)) (src/core/mask.hpp).
  Mask mask() const { return {Nk, causal, window_left, window_right}; }
  int64_t key_end(int64_t r) const { return mask().key_end(position(r) - k_pos0); }
  int64_t key_begin(int64_t r) const { return mask().key_begin(position(r) - k_pos0); }
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
struct Packing;
// Decode over the cache's pages, mirrored on the device (KVCache::device_state); q, out and lse on
// the device; opts' splits, window and stream (scale: the softmax scale). Returns when the results are written.
void decode_attention(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                      float* lse, float scale, const DecodeOptions& opts);
// All tensors on the current CUDA device; ordered on p.stream. With `packing` (prefill/packing.hpp),
// p holds packed sequences ([1, H, total, d]), attended in one call as each alone (packs(p)).
void dma_attention(const Problem& p, const Packing* packing = nullptr);
bool packs(const Problem& p);  // whether one call takes p's packed sequences (its policy and dtypes)
// dma_attention with p.lse's [B][Hq][Nq] rows written at dst, rows `stride` floats apart (varlen's [Hq, total_q]).
void dma_attention_lse_rows(Problem p, float* dst, int64_t stride);
}  // namespace cuda

}  // namespace dmattn
