// The mask in the prefill kernel (src/core/mask.hpp states it): the key tiles a CTA's query tile
// visits, and, per thread, the last key each of its two rows sees and the masking of a tile's scores.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/mask.hpp"
#include "cuda/prefill/smem.cuh"

namespace dmattn::cuda::prefill {

// Key tiles [0, tiles) hold every key the rows at positions [pos0, pos0 + BM) see.
__device__ __forceinline__ int key_tiles(const Mask& mask, int64_t pos0) {
  return int((mask.key_end(pos0 + BM - 1) + BN - 1) / BN);  // < 2^24: the host checks Nk < 2^31
}

// A thread's rows g and g + 8 of its warp's 16 (pos: their positions; valid: inside the output).
struct RowMask {
  int kmax[2];  // the last key each row sees; -1: none (a row outside the output or one before every key)

  __device__ __forceinline__ RowMask(const Mask& mask, const int64_t (&pos)[2], const bool (&valid)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) kmax[r] = valid[r] ? int(mask.last_key(pos[r])) : -1;
    // Opaque to ptxas, so it keeps the two ints instead of recomputing them from 64-bit positions in
    // every tile (~20 instructions a tile, SASS). Fits int: the host checks Nk < 2^31.
    asm volatile("" : "+r"(kmax[0]), "+r"(kmax[1]));
  }

  // Row r sees some key (kmax, not the positions: ptxas recomputed those from 64 bits every tile).
  __device__ __forceinline__ bool sees_any(int r) const { return kmax[r] >= 0; }

  // The scores of tile j's keys [key0, key0 + BN) in the accumulator layout: keys a row does not
  // see become -inf. A tile every row of the warp sees whole is skipped, in a branch of its own:
  // if-converted into the softmax's max loop the test costs every tile 128 instructions.
  __device__ __forceinline__ void apply(float (&s)[BN / 2], int key0, int t) const {
    const bool whole = __all_sync(0xffffffffu, key0 + BN - 1 <= min(kmax[0], kmax[1]));
    if (!whole)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i)
        if (key0 + acc_col(i, t) > kmax[(i / 2) % 2]) s[i] = -INFINITY;
  }
};

}  // namespace dmattn::cuda::prefill
