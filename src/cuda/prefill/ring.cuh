// The prefill CTA's shared memory as its roles address it (Smem states the plan): the Q slots and
// their scales, each stage's K tile, key scales, block scales, smooth_q additions and V^T, the
// barriers of the stage ring, and the warpgroups' Q-fold flags.
#pragma once
#include <cstdint>

#include "cuda/prefill/smem.cuh"
#include "cuda/ptx/tma.cuh"

namespace dmattn::cuda::prefill {

template <int D, bool kF8V, bool kNv, bool kFix>
struct Ring {
  using S = Smem<D, kF8V, kNv, kFix>;
  uint8_t* smem;  // the CTA's dynamic shared memory (1024-byte aligned)

  __device__ __forceinline__ uint8_t* q() const { return smem; }
  __device__ __forceinline__ float* q_scales() const { return reinterpret_cast<float*>(smem + S::kQ); }
  __device__ __forceinline__ uint8_t* vt(int st) const { return smem + S::kVt0 + st * S::kVStride; }
  __device__ __forceinline__ uint8_t* k(int st) const { return smem + S::kK0 + st * S::kKStride; }
  // The step's keys' row scales (folded tiles) and E8M0 block scales (per-block tiles).
  __device__ __forceinline__ float* key_scales(int st) const { return reinterpret_cast<float*>(k(st) + S::kOp); }
  __device__ __forceinline__ uint8_t* block_scales(int st) const { return k(st) + S::kOp + S::BN * 4; }
  // kFix: smooth_q's additions for the step's keys.
  __device__ __forceinline__ float* ds(int st) const { return reinterpret_cast<float*>(k(st) + S::kDs); }
  // A stage's copies have landed (full) and both consumer warpgroups are done with it (empty);
  // kSplit: the same pair for the stage's V, whose buffer frees after P.V.
  __device__ __forceinline__ uint64_t* full(int st) const { return reinterpret_cast<uint64_t*>(smem + S::kBars) + st; }
  __device__ __forceinline__ uint64_t* empty(int st) const { return full(S::kStages + st); }
  __device__ __forceinline__ uint64_t* vfull(int st) const { return full(2 * S::kStages + st); }
  __device__ __forceinline__ uint64_t* vempty(int st) const { return full(3 * S::kStages + st); }
  // [slot][warpgroup]: every Q row of the warpgroup has one scale for all of d.
  __device__ __forceinline__ int (*q_folded() const)[2] { return reinterpret_cast<int(*)[2]>(smem + S::kFlags); }

  // The barriers' counts and the fold flags (set until a warpgroup's Q says otherwise); the caller
  // synchronises the CTA after it.
  __device__ __forceinline__ void init() const {
    if (threadIdx.x < 4) q_folded()[threadIdx.x / 2][threadIdx.x % 2] = 1;
    if (threadIdx.x == 0) {
      for (int st = 0; st < S::kStages; ++st) {
        tma::init(full(st), 1);
        tma::init(empty(st), kConsumers);
        if constexpr (S::kSplit) {
          tma::init(vfull(st), 1);
          tma::init(vempty(st), kConsumers);
        }
      }
      tma::fence_init();
    }
  }
};

}  // namespace dmattn::cuda::prefill
