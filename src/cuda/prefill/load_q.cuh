// A consumer warpgroup's Q rows, both slots, from the quantize pass into shared memory.
#pragma once
#include "cuda/prefill/scheduler.cuh"
#include "cuda/prefill/smem.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "dmattn/mx_codec.hpp"

namespace dmattn::cuda::prefill {

// This warpgroup's 64 Q rows of both slots from the quantize pass's tensor-core form: FP8 bytes into
// swizzled shared memory (every load issued before any store), block scales as floats, and
// q_folded[slot][wgi] cleared where a row keeps several scales. Rows outside the sequence are zeros with
// scale 0. Each warpgroup loads its own rows, so warpgroup 1's run under warpgroup 0's first tile.
// kNv: slot by slot, an NVFP4 slot's rows as bf16 (2D bytes) in 128-byte atoms, with the row's second
// scale as its one scale. (The MX instances keep their own loop, both slots' loads issued
// before any store: the general one would change their SASS, which was measured as it stands.)
template <int D, bool kF8V, bool kNv, class Tile>
__device__ __forceinline__ void load_q(const PrefillParams& p, const Tile& tile, int64_t pos0, int64_t off, int wgi,
                                       uint8_t* sQ, float* sQs, int (*q_folded)[2]) {
  using S = Smem<D, kF8V, kNv>;
  constexpr int NB = D / 32, kChunks = D / 16, kLoads = 2 * 64 * kChunks / 128;
  const int tid = threadIdx.x % 128;
  const int64_t row0 = (int64_t(tile.b) * p.Hq + tile.h) * p.Nq + tile.row0();
  if constexpr (kNv) {
    constexpr int kMaxLoads = 64 * (2 * D / 16) / 128;
    for (int s = 0; s < 2; ++s) {
      const bool nv = s < p.nslots && p.op[s] == Operand::bf16;
      const int chunks = nv ? D / 8 : D / 16, wb = 16 * chunks;  // 16-byte chunks and bytes a row
      uint4 w[kMaxLoads];
#pragma unroll
      for (int k = 0; k < kMaxLoads; ++k) {
        const int i = tid + 128 * k, r = wgi * 64 + i / chunks, chunk = i % chunks;
        const int64_t qrow = pos0 + r - off;
        w[k] = i < 64 * chunks && s < p.nslots && qrow >= 0 && qrow < tile.nq()
                   ? *reinterpret_cast<const uint4*>(p.q8[s] + (row0 + qrow) * wb + chunk * 16)
                   : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int k = 0; k < kMaxLoads; ++k) {
        const int i = tid + 128 * k, r = wgi * 64 + i / chunks, byte = (i % chunks) * 16;
        if (i >= 64 * chunks) break;
        const uint32_t at = nv ? KMajorTile<2 * D, BM>::at(r, byte) : KMajorTile<D, BM>::at(r, byte);
        *reinterpret_cast<uint4*>(sQ + s * S::kQSlot + at) = w[k];
      }
    }
  } else {
    uint4 w[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = tid + 128 * k, s = i / (64 * kChunks), r = wgi * 64 + i / kChunks % 64, chunk = i % kChunks;
      const int64_t qrow = pos0 + r - off;
      w[k] = s < p.nslots && qrow >= 0 && qrow < tile.nq()
                 ? *reinterpret_cast<const uint4*>(p.q8[s] + (row0 + qrow) * D + chunk * 16)
                 : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = tid + 128 * k, s = i / (64 * kChunks), r = wgi * 64 + i / kChunks % 64, chunk = i % kChunks;
      *reinterpret_cast<uint4*>(sQ + s * S::kQSlot + KMajorTile<D, BM>::at(r, chunk * 16)) = w[k];
    }
  }
  // One (slot, row) a thread: its scales, and whether they agree.
  const int s = tid / 64, r = wgi * 64 + tid % 64;
  const int64_t qrow = pos0 + r - off;
  const bool ok = s < p.nslots && qrow >= 0 && qrow < tile.nq();
  const bool nv = kNv && s < p.nslots && p.op[s] == Operand::bf16;
  const float ts = nv && ok ? p.qten[s][row0 + qrow] : 0.0f;
  bool uniform = true;
  float first = 0.0f;
#pragma unroll
  for (int c = 0; c < NB; ++c) {
    const float v = nv ? ts : ok ? decode_e8m0(p.qs[s][(row0 + qrow) * NB + c]) : 0.0f;
    sQs[(s * BM + r) * NB + c] = v;
    first = c == 0 ? v : first;
    uniform &= v == first;
  }
  if (!uniform) q_folded[s][wgi] = 0;
}

}  // namespace dmattn::cuda::prefill
