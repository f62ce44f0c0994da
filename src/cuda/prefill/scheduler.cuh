// Which work a prefill CTA takes: one (sequence, query head, query tile) a CTA, the grid's y over the
// query heads.
// - A batch of equal sequences (TileScheduler<false>): x over the query tiles, z over the batch. The
//   latest query tiles go first: under a causal mask they see the most keys, so the short ones fill
//   the tail of the last wave instead of the long ones running alone at its end.
// - Packed sequences (TileScheduler<true>): x over the host's list of (sequence, query block),
//   longest first across all sequences (prefill/packing.hpp), z = 1.
// Both say where the sequence's rows lie (the same accessors), so the kernel's loads, mask and
// stores are one code; the batch's read the parameters directly, so its instances compile as they
// would without packed sequences.
#pragma once
#include <cstdint>

#include "core/mask.hpp"
#include "cuda/prefill/params.cuh"
#include "dmattn/policy.hpp"

namespace dmattn::cuda::prefill {

template <bool kPacked>
struct TileScheduler;

template <>
struct TileScheduler<false> {
  const PrefillParams& p;
  int b, h;      // batch and query head
  int64_t pos0;  // the query tile's first position (from the sequence's key 0)

  __device__ __forceinline__ explicit TileScheduler(const PrefillParams& params)
      : p(params), b(int(blockIdx.z)), h(int(blockIdx.y)),
        pos0((params.first_block + (params.blocks - 1 - blockIdx.x)) * kPrefillRows) {}

  __device__ __forceinline__ int64_t off() const { return p.q_pos0; }  // the position of query row 0
  __device__ __forceinline__ int64_t row0() const { return 0; }  // the (b, h) plane's rows before the sequence's
  __device__ __forceinline__ int nq() const { return p.Nq; }     // the sequence's query rows
  __device__ __forceinline__ int key0() const { return 0; }      // its first key slot in K's padded rows
  __device__ __forceinline__ const Mask& mask() const { return p.mask; }

  static dim3 grid(const PrefillParams& p, int64_t blocks, int batch) {
    return dim3(unsigned(blocks), unsigned(p.Hq), unsigned(batch));
  }
};

template <>
struct TileScheduler<true> {
  int b, h;
  int64_t pos0;
  int64_t off_, row0_;
  int nq_, key0_;
  Mask mask_;

  __device__ __forceinline__ explicit TileScheduler(const PrefillParams& p) : b(0), h(int(blockIdx.y)) {
    const SeqBlock w = p.work[blockIdx.x];
    const SeqSpan s = p.seqs[w.seq];
    pos0 = int64_t(w.block) * kPrefillRows;
    off_ = s.nk - s.nq;  // bottom-right within the sequence
    row0_ = s.q0;
    nq_ = s.nq;
    key0_ = s.tile0 * kTile;
    mask_ = p.mask;
    mask_.nk = s.nk;
  }

  __device__ __forceinline__ int64_t off() const { return off_; }
  __device__ __forceinline__ int64_t row0() const { return row0_; }
  __device__ __forceinline__ int nq() const { return nq_; }
  __device__ __forceinline__ int key0() const { return key0_; }
  __device__ __forceinline__ const Mask& mask() const { return mask_; }

  static dim3 grid(const PrefillParams& p, int64_t blocks, int) { return dim3(unsigned(blocks), unsigned(p.Hq), 1u); }
};

// The slot (0: high format, 1: low) of each step of kR steps a key tile: the policy's tiles
// (HighTiles) for a CTA's query tile, the producer's and the consumers' one rule.
template <int kR>
struct StepSlots {
  HighTiles high;
  int nslots;
  __device__ __forceinline__ int operator()(int j) const { return (nslots == 2 && !high(j / kR)) ? 1 : 0; }
};

}  // namespace dmattn::cuda::prefill
