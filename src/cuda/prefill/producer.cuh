// The prefill's producer warpgroup: one thread streams each step's K (in its tile's format), key
// scales, smooth_q additions and V^T into the stage ring with TMA, a stage once both consumer
// warpgroups have released it.
#pragma once
#include <cstdint>

#include "core/mask.hpp"
#include "cuda/prefill/params.cuh"
#include "cuda/prefill/ring.cuh"
#include "cuda/prefill/scheduler.cuh"
#include "cuda/ptx/tma.cuh"

namespace dmattn::cuda::prefill {

// Steps [kt.begin, kt.end) of query head h's KV head hk in batch b; key0: the sequence's first key in
// K's padded rows; kv_tile0: the row of that key in the per-key scales.
template <int D, bool kF8V, bool kNv, bool kFix, int kR>
__device__ __forceinline__ void produce(const PrefillParams& p, const Ring<D, kF8V, kNv, kFix>& ring, StepSlots<kR> slot_of,
                                        Mask::Tiles kt, int b, int h, int hk, int key0, int64_t kv_tile0) {
  using S = Smem<D, kF8V, kNv, kFix>;
  constexpr int NB = S::kNb, kStages = S::kStages, BN = S::BN;
  const int steps = kt.end;
  const int bh = b * p.Hkv + hk;
  for (int j = kt.begin, st = 0, phase = 0; j < steps; ++j, phase ^= (st == kStages - 1), st = (st + 1) % kStages) {
    const int slot = slot_of(j);
    const bool nv = kNv && p.op[slot] == Operand::bf16;  // bf16 K, no block scales
    if (j - kt.begin >= kStages) tma::wait(ring.empty(st), uint32_t(phase ^ 1));
    // kSplit: K's copies first, then V's into a ring whose buffer frees later (after P.V).
    const uint32_t ds_bytes = kFix && p.ds && p.policy.smooths_q(slot == 0) ? BN * 4 : 0;
    tma::arrive_expect(ring.full(st), (nv ? S::kTxKBf16 : S::kTxK) + (S::kSplit ? 0 : S::kVt) + ds_bytes);
    if (ds_bytes)  // smooth_q's additions of this head for the tile's keys
      tma::load_bytes(ring.ds(st), p.ds + (int64_t(b) * p.Hq + h) * p.ldv + key0 + int64_t(j) * BN, ds_bytes, ring.full(st));
    // K in its tile's swizzle atoms (KMajorTile), a TMA box each: bf16 rows of 2D bytes (coordinates in
    // elements), or FP8 rows of D bytes (two atoms at d = 256).
    if (nv) {
      using K = KMajorTile<2 * D, BN>;
      for (int a = 0; a < K::kAtoms; ++a)
        tma::load_3d(ring.k(st) + a * BN * K::kW, &p.kmap[slot], a * K::kW / 2, key0 + j * BN, bh, ring.full(st));
    } else {
      using K = KMajorTile<D, BN>;
      for (int a = 0; a < K::kAtoms; ++a)
        tma::load_3d(ring.k(st) + a * BN * K::kW, &p.kmap[slot], a * K::kW, key0 + j * BN, bh, ring.full(st));
    }
    tma::load_bytes(ring.key_scales(st), p.krs[slot] + kv_tile0 + int64_t(j) * BN, BN * 4, ring.full(st));
    if (!nv) tma::load_bytes(ring.block_scales(st), p.ks[slot] + (kv_tile0 + int64_t(j) * BN) * NB, BN * NB, ring.full(st));
    uint64_t* vbar = ring.full(st);
    if constexpr (S::kSplit) {
      vbar = ring.vfull(st);
      if (j - kt.begin >= kStages) tma::wait(ring.vempty(st), uint32_t(phase ^ 1));
      tma::arrive_expect(vbar, S::kVt);
    }
    tma::load_3d(ring.vt(st), &p.vmap, key0 + j * BN, 0, bh, vbar);
    if (!kF8V && BN == 128) tma::load_3d(ring.vt(st) + S::kVHalf, &p.vmap, key0 + j * BN + 64, 0, bh, vbar);
  }
}

}  // namespace dmattn::cuda::prefill
