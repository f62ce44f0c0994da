// The prefill kernel's shapes and its shared-memory plan: tile sizes, threads, and where each
// stage's K, V^T, scales and barriers live for an instance (head dim, P.V format, NVFP4 slots,
// accuracy-transform inputs).
#pragma once
#include <cuda.h>

#include <cstdint>

#include "cuda/prefill/params.cuh"

namespace dmattn::cuda::prefill {

constexpr int BM = kPrefillRows, BN = kTile;
constexpr int kConsumers = 256, kThreads = kConsumers + 128;  // 2 consumer warpgroups x 64 rows + a producer

// What the head dim decides beyond the sizes below, one entry a head dim (cuda/common/head_dims.hpp
// lists the ones built):
//  kKSwizzle: the swizzle of an FP8 Q or K tile, whose rows are D bytes (one swizzle atom a row;
//    wg::swizzled<D> lays the bytes out to match).
//  kTurns: the two consumer warpgroups take turns on the tensor cores (named barriers). At d = 64 the
//    turns cost more than they order: a tile's tensor work is half of d = 128's, so the two softmaxes,
//    not the tensor cores, bound the period and run faster side by side (bench/RESULTS.md: -9.1% at
//    N = 16384, -10.8% at 65536 for bf16 P.V, -2 to -4% for pv = fp8 and NVFP4). At d = 128 dropping
//    them measured -0.5 to +1.5% (bf16 P.V) and up to +3.7% (pv = fp8).
template <int D>
struct Tiling;
template <>
struct Tiling<64> {
  static constexpr CUtensorMapSwizzle kKSwizzle = CU_TENSOR_MAP_SWIZZLE_64B;
  static constexpr bool kTurns = false;
};
template <>
struct Tiling<128> {
  static constexpr CUtensorMapSwizzle kKSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  static constexpr bool kTurns = true;
};

// Shared memory (every tile 1024-byte aligned, as the swizzle needs):
//   Q: [2 slots][BM rows][D bytes] swizzled, then Q scales as floats [2][BM][D/32];
//   per stage: V^T as two [D][64 keys] bf16 halves (128-byte rows), or with kF8V (pv = fp8) as one
//   [D][128 keys] E4M3 tile, K [BN][D bytes], the keys' row scales [BN] floats (folded tiles) and
//   block scales [BN][D/32] E8M0 bytes (per-block tiles); then the stages' full/empty barriers and
//   the Q-fold flags. (kSplit: every stage's V^T first, then every stage's K with its scales.)
// kNv (some slot is NVFP4: instances of their own, so the MX ones keep their layout and code): an
// NVFP4 slot's Q and its K tiles are bf16 (the bf16 Operand), twice the bytes, as [D/64 atoms][rows]
// [128 B]; every Q slot and K tile gets that room. Where 3 stages do not fit (d = 128, bf16 V), K and
// V go in rings of 2 stages each (kSplit), with barriers of their own: a tile's K is released once its
// S has retired, its V once its P.V has, so each copy starts as soon as its own buffer frees. One ring of
// 2 stages cost the MX kernel 27% at N = 16384 (bench/RESULTS.md).
template <int D, bool kF8V, bool kNv = false, bool kFix = false>
struct Smem {
  static constexpr int kNb = D / 32;
  static constexpr int kQK = BN * D;              // one FP8 K tile or Q slot
  static constexpr int kOp = kNv ? 2 * kQK : kQK;  // the room a Q slot or K tile takes
  static constexpr int kVHalf = D * 128, kVt = kF8V ? kVHalf : 2 * kVHalf;
  static constexpr int kQ = 2 * kOp, kQs = 2 * BM * kNb * 4;
  // K + BN floats and BN * kNb bytes (<= 1024 for D <= 128); kFix: then smooth_q's BN floats.
  static constexpr int kKStage = kOp + 1024 + (kFix ? 1024 : 0);
  static constexpr int kDs = kOp + 1024;  // offset of the ds floats in a K stage (kFix)
  static constexpr int kStage = kVt + kKStage;
  static constexpr uint32_t kTxK = kQK + BN * 4 + BN * kNb;  // bytes an MX tile's K copies bring
  static constexpr uint32_t kTxKBf16 = 2 * kQK + BN * 4;     // an NVFP4 tile's (no block scales)
  static_assert(BN * 4 + BN * kNb <= 1024);
  static constexpr bool kSplit = kQ + kQs + 3 * kStage + 64 > 227 * 1024;
  static constexpr int kStages = kSplit ? 2 : 3;  // of the one ring, or of each of the split rings
  // Stage st's V^T at kVt0 + st * kVStride, its K at kK0 + st * kKStride.
  static constexpr int kVt0 = kQ + kQs, kVStride = kSplit ? kVt : kStage;
  static constexpr int kK0 = kVt0 + (kSplit ? kStages * kVt : kVt), kKStride = kSplit ? kKStage : kStage;
  // uint64_t full[kStages], empty[kStages] (the tile's copies, or kSplit its K's); kSplit: vfull, vempty
  static constexpr int kBars = kQ + kQs + kStages * kStage;
  static constexpr int kFlags = kBars + (kSplit ? 4 : 2) * kStages * 8;  // int q_folded[2][2]
  static constexpr int kBytes = kFlags + 16;
  static_assert(kQ % 1024 == 0 && kQs % 1024 == 0 && kStage % 1024 == 0);
  static_assert(kBytes <= 227 * 1024, "more shared memory than an sm_90 CTA can have");
};

// The accumulator register i of a m64nN tile holds column 8*(i/4) + 2t + (i%2) of row half (i/2)%2.
__device__ __forceinline__ int acc_col(int i, int t) { return 8 * (i / 4) + 2 * t + (i % 2); }

}  // namespace dmattn::cuda::prefill
