// Which work a prefill CTA takes: one (batch, query head, query tile) a CTA, the grid's x over the
// query tiles, y over the query heads, z over the batch. The latest query tiles go first: under a
// causal mask they see the most keys, so the short ones fill the tail of the last wave instead of
// the long ones running alone at its end. (A persistent, load-balanced scheduler would replace this
// piece and its grid.)
#pragma once
#include <cstdint>

#include "cuda/prefill/params.cuh"

namespace dmattn::cuda::prefill {

struct TileScheduler {
  int b, h;      // batch and query head
  int64_t pos0;  // the query tile's first position (from key 0)

  __device__ __forceinline__ explicit TileScheduler(const PrefillParams& p)
      : b(int(blockIdx.z)), h(int(blockIdx.y)), pos0((p.first_block + (p.blocks - 1 - blockIdx.x)) * kPrefillRows) {}

  // The grid that gives every tile its CTA.
  static dim3 grid(const PrefillParams& p, int64_t blocks, int batch) {
    return dim3(unsigned(blocks), unsigned(p.Hq), unsigned(batch));
  }
};

}  // namespace dmattn::cuda::prefill
