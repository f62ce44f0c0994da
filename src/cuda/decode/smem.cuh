// The decode kernel's shared-memory plan for an instance (head dim, V's bits, rows, CTAs an SM).
#pragma once
#include <algorithm>

#include "cuda/decode/kv_record.hpp"
#include "cuda/decode/params.cuh"

namespace dmattn::cuda::decode {

// Shared memory. Each warp streams its own 32 keys of every page through its own kStages buffers,
// one record (kv_record.hpp) each, brought by one bulk copy and signalled by the stage's mbarrier
// (so it waits for its own copies only); the warps meet once a page, to agree on the rows' maximum.
// kNR: query rows per CTA in tiles of 8 (the N of mma.sync; more rows take more CTAs).
template <int D, int kVB, int kNR, int kCtas>
struct Smem {  // byte offsets into dynamic shared memory
  static constexpr bool kPV8 = kVB != 16;  // V in MX codes (8 or 4 bits)
  static constexpr int NB = D / 32, kRows = 8 * kNR;

  // Per warp and stage: a record. K rows (E2M1: D/2 bytes, else D) end where the keys' E8M0 scales
  // [32][NB] begin, then V: bf16 rows [32 keys][d], or (pv = mxfp8 / mxfp4) V^T [d][32 keys] E4M3
  // bytes / E2M1 nibbles (keys in fragment order) and the block's E8M0 scales [d].
  static constexpr int kWarpStage = record_bytes(D, kVB);
  static constexpr int kQbBytes = 2 * NB * kNR * 2 * 32 * 4;
  static constexpr int kBarBytes = 4 * kWarps * 8;  // mbarriers, room for four stages
  static constexpr int kMisc = 128 + 2 * kWarps * kRows * 4 + kQbBytes + 2 * NB * kRows * 4 + kBarBytes;
  // As many stages as leave kCtas CTAs an SM: more bytes in flight per warp.
  static constexpr int kStages = std::min(4, ((227 / kCtas - 1) * 1024 - kMisc) / (kWarps * kWarpStage));
  static constexpr int kLut = kStages * kWarps * kWarpStage;  // [2][64] FP6 code -> E4M3 byte
  static constexpr int kMax = kLut + 128;                       // [2][kWarps][kRows] floats: row maxima
  static constexpr int kQb = kMax + 2 * kWarps * kRows * 4;     // q's B fragments [2][NB][kNR][2][32 lanes] uint32
  static constexpr int kSq = kQb + kQbBytes;                    // q's block scales [2][NB][kRows] floats
  static constexpr int kBar = kSq + 2 * NB * kRows * 4;         // [kWarps][kStages] uint64_t: a stage's copy landed
  static constexpr int kBytes = kBar + kBarBytes;
  static_assert(kStages >= 2 && kWarpStage % 16 == 0 && kBar % 8 == 0 && kBytes - kLut == kMisc);
  static_assert(kWarps * kRows * D * 4 <= kLut, "the final cross-warp sum reuses the stage buffers");
};

}  // namespace dmattn::cuda::decode
