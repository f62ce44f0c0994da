// S = Q.K^T for one key tile and one warpgroup's 64 query rows, in each of the ways a tile's
// tensor-core form (Operand) asks for: one wgmma chain over d (folded scales; FP8 or bf16), or one
// FP8 wgmma per 32-wide block promoted with its block scales; then the key scales and the accuracy
// transforms' share.
#pragma once
#include "cuda/common/operand.hpp"
#include "cuda/prefill/smem.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "dmattn/mx_codec.hpp"

namespace dmattn::cuda::prefill {

// Multiplies S (N keys) by the keys' row scales (smem, adjacent pairs); the rows' factors are
// applied later, inside the softmax's exponent (one FFMA).
template <int N>
__device__ __forceinline__ void scale_by_keys(float (&s)[N / 2], const float* sks, int t) {
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
    const float2 k = *reinterpret_cast<const float2*>(sks + acc_col(4 * nt, t));
    s[4 * nt] *= k.x;
    s[4 * nt + 1] *= k.y;
    s[4 * nt + 2] *= k.x;
    s[4 * nt + 3] *= k.y;
  }
}

// S for this warpgroup's 64 rows x the step's keys (Tiling<D>::kBN; docs/DESIGN.md):
//  - folded tile: all of d as one wgmma chain (issued and committed here, awaited by the caller),
//    then the key scales (scale_by_keys) and the row scales (in the softmax) once;
//  - otherwise one wgmma per (64 keys, 32-wide block) into a fresh accumulator, promoted with
//    the block scales sq * sk on the CUDA cores (this retires every wgmma in flight).
// Precision (GpuMma.WgmmaFp8DotPrecision): Hopper's FP8 wgmma keeps about 13 bits of its sum, so
// E4M3/FP6 blocks, and chains over blocks of different magnitude, differ from the oracle's fp32 sums
// by up to ~1e-4 of sum|p|; one block of E2M1 values is exact. Measured against the oracle: <= 1e-3
// rel. L2 (bench/RESULTS.md). A ping-pong variant of the per-block path (two accumulators in
// flight) ran 3x slower than this serial one on the H200.
// sq, sk: descriptors of the warpgroup's Q slot and the stage's K tile.
//
// The bf16 form (NVFP4 tiles): Q and K arrive as bf16 values with their E4M3 block scales folded in
// (an E2M1 value times an E4M3 scale has at most 6 significant bits: exact in bf16), so all of d
// runs as one bf16 wgmma chain, 16 elements a wgmma, in 128-byte swizzle atoms of 64 elements
// ([atom][rows][128 B]); the rows' second scales multiply S once, Q's as the row factor of the folded
// path and K's as its per-key factor (the tile marked "a scale a key").
template <int D, Operand Op, int BN = Tiling<D>::kBN>
__device__ __forceinline__ void issue_chain(float (&s)[BN / 2], wg::Desc sq, wg::Desc sk) {
  wg::fence();  // in the wgmmas' basic block: ptxas serialises every wgmma when it must insert one itself
  if constexpr (OperandTraits<Op>::kFp8) {
#pragma unroll
    for (int c = 0; c < D / 32; ++c)
      wg::mma_fp8<BN, OperandTraits<Op>::kE5M2>(s, (sq + KMajorTile<D, BM>::k_step(c)).u64(),
                                                (sk + KMajorTile<D, BN>::k_step(c)).u64(), c > 0);
  } else {
#pragma unroll
    for (int k = 0; k < D / 16; ++k)
      wg::mma_bf16<BN>(s, (sq + KMajorTile<2 * D, BM>::k_step(k)).u64(), (sk + KMajorTile<2 * D, BN>::k_step(k)).u64(), k > 0);
  }
  wg::commit();
}

template <int D, Operand Op, int BN = Tiling<D>::kBN>
__device__ __forceinline__ void scores_per_block(float (&s)[BN / 2], wg::Desc sq, const float* sqs, wg::Desc sk,
                                                 const uint8_t* sks8, float scale, int t) {
  static_assert(OperandTraits<Op>::kFp8, "the bf16 form has no block scales of its own: it always folds");
  constexpr int NB = D / 32, kW = KMajorTile<D, BN>::kW;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
#pragma unroll
  for (int half = 0; half < BN / 64; ++half)  // 64 keys at a time
#pragma unroll 1
    for (int c = 0; c < NB; ++c) {
      float part[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) part[i] = 0.0f;
      wg::fence();
      wg::mma_fp8<64, OperandTraits<Op>::kE5M2>(part, (sq + KMajorTile<D, BM>::k_step(c)).u64(),
                                                (sk + (half * 64 * kW + KMajorTile<D, BN>::k_step(c))).u64(), false);
      wg::commit();
      wg::wait<0>();
      wg::pin(part);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const float k = decode_e8m0(sks8[(half * 64 + acc_col(i, t)) * NB + c]);
        s[half * 32 + i] += sqs[((i / 2) % 2) * 8 * NB + c] * k * part[i];
      }
    }
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] *= scale;
}

// The accuracy transforms' share of a step's N scores (kFix instances): S in logits, plus smooth_q's
// per-key addition (ds: the step's N floats in shared memory, brought with its K), and the exact
// scores of the sink keys among them (the step's first key is key0; sink0, sink1: the rows' sink
// scores, keys 0 .. sink_keys - 1). u: each row's factor from S to logits (1 where S already
// holds them).
template <int N>
__device__ __forceinline__ void fix_scores(float (&s)[N / 2], const float (&u)[2], const float* ds,
                                           const float* sink0, const float* sink1, int key0, int sink_keys, int t) {
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
    const float2 a = ds ? *reinterpret_cast<const float2*>(ds + acc_col(4 * nt, t)) : make_float2(0.0f, 0.0f);
    s[4 * nt] = fmaf(s[4 * nt], u[0], a.x);
    s[4 * nt + 1] = fmaf(s[4 * nt + 1], u[0], a.y);
    s[4 * nt + 2] = fmaf(s[4 * nt + 2], u[1], a.x);
    s[4 * nt + 3] = fmaf(s[4 * nt + 3], u[1], a.y);
  }
  if (key0 < sink_keys)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const int key = key0 + acc_col(i, t);
      if (key < sink_keys) s[i] = ((i / 2) % 2 ? sink1 : sink0)[key];
    }
}

}  // namespace dmattn::cuda::prefill
