// The mask in the prefill kernel (src/core/mask.hpp states it): the key tiles a CTA's query tile
// visits, and, per thread, the keys each of its two rows sees and the masking of a tile's scores.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/mask.hpp"
#include "cuda/prefill/smem.cuh"

namespace dmattn::cuda::prefill {

// The steps of BN keys [begin, end) a CTA's query tile at positions [pos0, pos0 + BM) visits
// (Mask::key_tiles; the host checks Nk < 2^31).
template <int BN>
__device__ __forceinline__ Mask::Tiles key_steps(const Mask& mask, int64_t pos0) { return mask.key_tiles(pos0, BM, BN); }

// A thread's rows g and g + 8 of its warp's 16 (pos: their positions; valid: inside the output).
struct RowMask {
  int kmin[2], kmax[2];  // the keys [kmin, kmax] each row sees; kmax -1: none (a row outside the output,
                         // before every key or with an empty window)

  __device__ __forceinline__ RowMask(const Mask& mask, const int64_t (&pos)[2], const bool (&valid)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t begin = mask.key_begin(pos[r]), end = mask.key_end(pos[r]);
      kmin[r] = int(begin);
      kmax[r] = valid[r] && begin < end ? int(end - 1) : -1;
    }
    // Opaque to ptxas, so it keeps the ints instead of recomputing them from 64-bit positions in
    // every tile (~20 instructions a tile, SASS). Fits int: the host checks Nk < 2^31.
    asm volatile("" : "+r"(kmin[0]), "+r"(kmin[1]), "+r"(kmax[0]), "+r"(kmax[1]));
  }

  // Row r sees some key (kmax, not the positions: ptxas recomputed those from 64 bits every tile).
  __device__ __forceinline__ bool sees_any(int r) const { return kmax[r] >= 0; }

  // The scores of a step's keys [key0, key0 + BN) in the accumulator layout: keys a row does not
  // see become -inf. A step every row of the warp sees whole is skipped, in a branch of its own:
  // if-converted into the softmax's max loop the test costs every tile 128 instructions.
  template <int BN>
  __device__ __forceinline__ void apply(float (&s)[BN / 2], int key0, int t) const {
    const bool whole = __all_sync(0xffffffffu, key0 >= max(kmin[0], kmin[1]) && key0 + BN - 1 <= min(kmax[0], kmax[1]));
    if (!whole)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const int key = key0 + acc_col(i, t), r = (i / 2) % 2;
        if (key > kmax[r] || key < kmin[r]) s[i] = -INFINITY;
      }
  }
};

}  // namespace dmattn::cuda::prefill
