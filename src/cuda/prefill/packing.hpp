// Packed variable-length sequences (flash-attn's varlen layout) as the CUDA prefill takes them in
// one call: the sequences' spans, the prefill's work list, and the maps the pre-pass uses to give
// each sequence's keys whole 128-key tiles of their own ("slots" of K's padded rows), so every
// sequence is attended exactly as it is alone.
#pragma once
#include <cstdint>
#include <vector>

#include "core/mask.hpp"

namespace dmattn::cuda {

// Sequence i: query rows [q0, q0 + nq) and key rows [k0, k0 + nk) of the packed tensors; its keys
// take the padded key slots from 128 * tile0 on.
struct SeqSpan {
  int32_t q0, nq, k0, nk, tile0;
};

// One prefill CTA's work: the sequence and the query block (128 positions from the sequence's key 0;
// negative where it has more queries than keys).
struct SeqBlock {
  int32_t seq, block;
};

// The device copies (one upload), for the pre-pass kernels and the prefill.
struct PackedMaps {
  const SeqSpan* seqs = nullptr;
  int nseq = 0;
  const SeqBlock* work = nullptr;
  int64_t works = 0;
  const int32_t* key_slot = nullptr;   // [total_k]: each key row's padded slot
  const int32_t* key_seq = nullptr;    // [total_k]: each key row's sequence
  const int32_t* slot_key = nullptr;   // [ldv]: each padded slot's key row, -1 for padding
  const int32_t* query_seq = nullptr;  // [total_q]: each query row's sequence
  int64_t ldv = 0;                     // padded key slots: 128 x the sequences' key tiles
};

// The same tables on the host, in one int32 array (offsets in words), built from the offsets.
struct Packing {
  std::vector<int32_t> words;
  size_t seqs = 0, work = 0, key_slot = 0, key_seq = 0, slot_key = 0, query_seq = 0;
  int nseq = 0;
  int64_t works = 0, ldv = 0;

  // cu_q, cu_k: validated offsets (0 .. total, non-decreasing, a sequence with queries has keys);
  // mask: the call's (its nk unused) to order the work longest first.
  Packing(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, const Mask& mask);
  // The device view of a copy of `words` at `base`.
  PackedMaps on(const int32_t* base) const;
};

}  // namespace dmattn::cuda
