// Context-parallel ("ring") attention for prefill: the sequence is sharded over R ranks; each rank
// keeps its query shard while the key/value shards travel the ring, one step per rank, and the
// partial results merge by LSE. The DMA policy and the causal mask use absolute positions, so
// every (query tile, key tile) pair sees the formats of the single-device definition.
//
// This is the schedule and merge logic with the ranks simulated in one process on the CPU (the
// NCCL transport is not built yet). Exactness: each rank runs a key shard's tiles in ascending
// order, but a row's shards arrive in ring order and merge by LSE, so P is rounded to bf16 against
// each partial maximum rather than the running one: outputs agree with single-device attention to
// bf16-P rounding (~1e-3 rel. L2), LSE to fp32 rounding.
#pragma once
#include <cstdint>
#include <vector>

#include "dmattn/attention.hpp"

namespace dmattn {

enum class Sharding : uint8_t {
  contiguous,  // rank r holds chunk r of R
  zigzag,      // rank r holds chunks r and 2R-1-r of 2R: equal causal work per rank
};

struct RingPlan {
  int ranks = 1;
  Sharding sharding = Sharding::zigzag;
  int64_t n = 0;      // sequence length (self-attention: queries = keys)
  int64_t chunk = 0;  // tokens per chunk, a multiple of the 128-token tile

  // n must split into whole 128-token tiles per chunk (R chunks, or 2R for zigzag).
  static RingPlan make(int64_t n, int ranks, Sharding sharding);
  std::vector<int64_t> chunks_of(int rank) const;  // ascending
  // At step s (0..ranks-1) rank r holds the key/value shard that started on rank (r - s) mod R.
  int kv_source(int rank, int step) const { return ((rank - step) % ranks + ranks) % ranks; }
};

struct RingStats {
  std::vector<int64_t> tile_pairs;  // per rank: (query tile, key tile) pairs with a visible key
};

// q, k, v: full [B, H, n, d] CPU views (each simulated rank reads only its shards); out and lse
// (or null) full. MX formats and bf16 tiles; rotate, smooth_k and smooth_q (their key and query
// means over the whole sequence, as one device's: the all-reduces a real ring takes first). NVFP4's
// tensor scale, pv = fp8's channel scales and sink_keys are refused.
void ring_attention_simulated(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              float* lse, const AttentionOptions& opts, const RingPlan& plan,
                              RingStats* stats = nullptr);

}  // namespace dmattn
