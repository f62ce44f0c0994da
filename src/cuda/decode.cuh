// Decode over KV-cache pages on the GPU (semantics: include/dmattn/kv_cache.hpp). decode_paged() is
// the one kernel entry; the KV cache mirror (kv_mirror.cu) and the decode benchmark both call it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "dmattn/policy.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn::cuda {

// A device view of cache pages. Page p owns Hkv*128*d bytes of K codes from codes + p*Hkv*128*d,
// holding [Hkv][128] rows of the format's code bytes (d/2 for E2M1, two per byte, low nibble
// first; d otherwise: an E2M1 page fills half its slot); the E8M0 scales of page p, head h at
// scales + (p*Hkv + h)*128*(d/32), bf16 V at v + (p*Hkv + h)*128*d. That is the host page's layout
// (KVCache::Page), so a page is uploaded as it is stored.
struct PagedKV {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const uint16_t* v = nullptr;
  const uint8_t* slot = nullptr;    // [pages] K's format: 0 = the policy's high format, 1 = low
  const int32_t* table = nullptr;   // [S][max_pages] physical page of each logical page
  const int32_t* length = nullptr;  // [S] tokens per sequence
  int S = 0, max_pages = 0, Hkv = 0, d = 0;
  // pv = mxfp8 (instead of v): page p, head h's V as V^T, [d][128] E4M3 codes at
  // v8 + (p*Hkv + h)*128*d (columns contiguous over keys: the FP8 mma's B operand; within each
  // 32-key block the keys in the order vt_position gives), and the E8M0 scales of its 32-key
  // blocks, [4][d], at vs + (p*Hkv + h)*4*d (the host page's layout). pv = mxfp4: E2M1 codes,
  // [d][64] bytes at v8 + (p*Hkv + h)*64*d; in each column's 16 bytes per 32-key block, 32-bit word t
  // holds keys 8j + 2t and 8j + 2t + 1 (j = 0..3) placed for f16 (e2m1x8_f16_pack).
  const uint8_t* v8 = nullptr;
  const uint8_t* vs = nullptr;
};

// Where key k (0..127) of a page sits in a row of the device V^T: within its 32-key block, lane t of
// the mma's B fragment reads bytes 8t..8t+7, which must hold keys 2t, 2t+1, 8+2t, 9+2t and the same
// plus 16 (the keys its P fragment holds, see decode.cu).
constexpr int vt_position(int k) {
  const int r = k % 16;
  return k / 32 * 32 + 8 * ((r % 8) / 2) + 4 * (k % 32 / 16) + (r % 2) + 2 * (r / 8);
}

// q, out: [S, Hq, Nq, d] CUDA views (unit stride on d); lse [S*Hq*Nq] device floats or null. splits
// 0 = automatic. Enqueues the work on `stream` (q's quantization, the decode, the split merge) and
// sets *nonfinite (device memory) to 1 if q holds NaN/Inf; throws dmattn::Error on bad arguments.
void decode_paged_async(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                        float scale, int splits, int* nonfinite, cudaStream_t stream);

// The same, synchronous: returns when the results are written; NaN/Inf in q throws.
void decode_paged(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                  float scale, int splits, cudaStream_t stream);

}  // namespace dmattn::cuda
