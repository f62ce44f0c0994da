// The prefill kernel's shapes and its shared-memory plan: tile sizes, threads, and where each
// stage's K, V^T, scales and barriers live for an instance (head dim, P.V format, NVFP4 slots,
// accuracy-transform inputs).
#pragma once
#include <cuda.h>

#include <cstdint>

#include "cuda/common/head_dims.hpp"
#include "cuda/prefill/params.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace dmattn::cuda::prefill {

constexpr int BM = kPrefillRows;
constexpr int kConsumers = 256, kThreads = kConsumers + 128;  // 2 consumer warpgroups x 64 rows + a producer

// What the head dim decides beyond the sizes below, one entry a head dim (cuda/common/head_dims.hpp
// lists the ones built):
//  kBN: the keys of one step of the kernel's loop: a whole key tile (kTile), or at d = 256 half of
//    one, so that a warpgroup's O (128 registers a thread) and the step's S and P fit in its 240.
//    A step keeps its tile's format and scales.
//  kKSwizzle: the swizzle of an FP8 Q or K tile; its rows are D bytes, one swizzle atom a row up to
//    128 bytes, and at d = 256 two atoms (KMajorTile lays the bytes out to match).
//  kTurns: the two consumer warpgroups take turns on the tensor cores (named barriers). At d = 64 the
//    turns cost more than they order: a tile's tensor work is half of d = 128's, so the two softmaxes,
//    not the tensor cores, bound the period and run faster side by side (bench/RESULTS.md: -9.1% at
//    N = 16384, -10.8% at 65536 for bf16 P.V, -2 to -4% for pv = fp8 and NVFP4). At d = 128 dropping
//    them measured -0.5 to +1.5% (bf16 P.V) and up to +3.7% (pv = fp8). A d = 256 step's tensor work
//    is d = 128's.
template <int D>
struct Tiling;
template <>
struct Tiling<64> {
  static constexpr int kBN = kTile;
  static constexpr CUtensorMapSwizzle kKSwizzle = CU_TENSOR_MAP_SWIZZLE_64B;
  static constexpr bool kTurns = false;
};
template <>
struct Tiling<128> {
  static constexpr int kBN = kTile;
  static constexpr CUtensorMapSwizzle kKSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  static constexpr bool kTurns = true;
};
template <>
struct Tiling<256> {
  static constexpr int kBN = kTile / 2;
  static constexpr CUtensorMapSwizzle kKSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  static constexpr bool kTurns = true;
};

// The head dims whose kernel runs pv = fp8 and NVFP4 tiles: at d = 256 their operands (E4M3 V^T of
// 64-key rows, bf16 Q and K) leave no room for three stages, and neither instance is built.
template <int D>
constexpr bool kAllForms = D <= kPrefillAllFormsMaxHeadDim;

// A K-major tile of Rows rows of W bytes (an FP8 Q or K tile: W = d; the bf16 form's: W = 2d): up to
// 128 bytes a row is one swizzle atom (wg::swizzled<W>); wider rows are [W / 128 atoms][Rows][128 B],
// so a wgmma's 32-byte k-step never crosses an atom.
template <int W, int Rows>
struct KMajorTile {
  static constexpr int kW = W < 128 ? W : 128;  // the swizzle atom's row, and the descriptors' W
  static constexpr int kAtoms = W / kW;          // atoms a row (a TMA box each)
  static __device__ __forceinline__ uint32_t at(uint32_t row, uint32_t byte) {
    if constexpr (W <= 128)
      return wg::swizzled<W>(row, byte);
    else
      return (byte / 128) * (Rows * 128) + wg::swizzled<128>(row, byte % 128);
  }
  // The descriptor offset of k-step c (32 bytes of every row).
  static __host__ __device__ constexpr uint32_t k_step(int c) {
    if constexpr (W <= 128)
      return c * 32;
    else
      return (c * 32 / 128) * (Rows * 128) + (c * 32) % 128;
  }
};

// Shared memory (every tile 1024-byte aligned, as the swizzle needs):
//   Q: [2 slots][BM rows][D bytes] (KMajorTile), then Q scales as floats [2][BM][D/32];
//   per stage: V^T as [D][64 keys] bf16 halves (128-byte rows), one a 64 keys of the step, or with
//   kF8V (pv = fp8) as one [D][128 keys] E4M3 tile, K [kBN][D bytes], the keys' row scales [kBN]
//   floats (folded tiles) and block scales [kBN][D/32] E8M0 bytes (per-block tiles); then the
//   stages' full/empty barriers and the Q-fold flags. (kSplit: every stage's V^T first, then every
//   stage's K with its scales.)
// kNv (some slot is NVFP4: instances of their own, so the MX ones keep their layout and code): an
// NVFP4 slot's Q and its K tiles are bf16 (the bf16 Operand), twice the bytes, as [D/64 atoms][rows]
// [128 B] (KMajorTile of 2D bytes a row); every Q slot and K tile gets that room. Where 3 stages do not fit (d = 128, bf16 V), K and
// V go in rings of 2 stages each (kSplit), with barriers of their own: a tile's K is released once its
// S has retired, its V once its P.V has, so each copy starts as soon as its own buffer frees. One ring of
// 2 stages cost the MX kernel 27% at N = 16384 (bench/RESULTS.md).
template <int D, bool kF8V, bool kNv = false, bool kFix = false>
struct Smem {
  static constexpr int BN = Tiling<D>::kBN;
  static constexpr int kNb = D / 32;
  static constexpr int kQSlot = (kNv ? 2 : 1) * BM * D;  // the room a Q slot takes
  static constexpr int kQK = BN * D;                     // one FP8 K tile
  static constexpr int kOp = kNv ? 2 * kQK : kQK;        // the room a K tile takes
  static constexpr int kVHalf = D * 128, kVt = kF8V ? kVHalf : (BN / 64) * kVHalf;
  static constexpr int kQ = 2 * kQSlot, kQs = 2 * BM * kNb * 4;
  // K + BN floats and BN * kNb bytes (<= 1024 for D <= 256); kFix: then smooth_q's BN floats.
  static constexpr int kKStage = kOp + 1024 + (kFix ? 1024 : 0);
  static constexpr int kDs = kOp + 1024;  // offset of the ds floats in a K stage (kFix)
  static constexpr int kStage = kVt + kKStage;
  static constexpr uint32_t kTxK = kQK + BN * 4 + BN * kNb;  // bytes an MX tile's K copies bring
  static constexpr uint32_t kTxKBf16 = 2 * kQK + BN * 4;     // an NVFP4 tile's (no block scales)
  static_assert(BN * 4 + BN * kNb <= 1024);
  static_assert(kAllForms<D> || (!kF8V && !kNv), "d = 256 takes MX tiles and pv = bf16");
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
