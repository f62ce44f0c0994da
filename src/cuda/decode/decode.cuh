// Decode over KV-cache pages on the GPU (semantics: include/dmattn/kv_cache.hpp). decode_paged() is
// the one kernel entry; the KV cache mirror (kv_mirror.cu) and the decode benchmark both call it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode/kv_record.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/policy.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn::cuda {

// A device view of cache pages: page p, KV head h, keys 32w..32w+31 (w = 0..3) are the record at
// rec + ((p*Hkv + h)*4 + w) * record_bytes(d, vbits) (kv_record.hpp: K codes in the page's format,
// K's scales, V in the policy's pv format). Keys at or past a sequence's length in its last page
// must hold finite V (the mirror's pages hold zeros there): P = 0 multiplies them.
struct PagedKV {
  const uint8_t* rec = nullptr;
  const uint8_t* slot = nullptr;    // [pages] K's format: 0 = the policy's high format, 1 = low
  const int32_t* table = nullptr;   // [S][stride] physical page of each logical page (the first max_pages)
  const int32_t* length = nullptr;  // [S] tokens per sequence
  int S = 0, max_pages = 0, Hkv = 0, d = 0;
  int vbits = 16;                   // V's bits in the records (16, 8, 4): must match the policy's pv
  int stride = 0;                   // table entries a sequence (0: max_pages)
  const int32_t* gate = nullptr;    // set: where gate[1] (a stale graph replay, append.cuh), every length reads 0

  __host__ __device__ const int32_t* row(int64_t s) const { return table + s * (stride > 0 ? stride : max_pages); }
  __host__ __device__ int length_of(int64_t s) const { return gate && gate[1] ? 0 : length[s]; }
};

// One host page's records (kv_record.hpp), [Hkv][4 blocks][record], as the device mirror uploads
// them (kv_mirror.cu); the device cache's tests compare its pages with them.
void pack_page(const KVCache::Page& pg, int64_t Hkv, int d, int vbits, uint8_t* dst);

// V's bits in the records for a pv mode (bf16 16, mxfp8 8, mxfp4 4).
inline int v_bits(PV pv) { return pv == PV::bf16 ? 16 : pv == PV::mxfp8 ? 8 : 4; }

// The accuracy transforms on decode's side (include/dmattn/kv_cache.hpp): with any transform on,
// each query row is rotated (rotate) and rounded to bf16 before quantization, the sink keys' scores
// are computed exactly from the rotated fp32 row, and smooth_k's LSE shift q.mean(K) x scale is added.
struct QueryTransform {
  bool on = false, rotate = false, smooth_k = false;
  int sink_keys = 0;
  // The sequences' state (KVCache::Page::state) by physical page: page p's at state + p * Hkv * rows * d,
  // [Hkv][rows][d] floats (smooth_k's mean, then the sink rows), read at each sequence's first page.
  const float* state = nullptr;
  int rows = 0;
};

// q, out: [S, Hq, Nq, d] CUDA views (unit stride on d); lse [S*Hq*Nq] device floats or null. splits
// 0 = automatic. Enqueues the work on `stream` (q's quantization, the decode, the split merge) and
// sets *nonfinite (device memory) to 1 if q holds NaN/Inf; throws dmattn::Error on bad arguments.
// The scale is the caller's softmax scale; with qt.rotate the rotation's block size is divided out here.
// window_left >= 0: a sliding window (a query at position p sees keys [p - window_left, p]); pages
// wholly before every row's window are not read.
void decode_paged_async(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                        float scale, int splits, int* nonfinite, cudaStream_t stream, const QueryTransform& qt = {},
                        int64_t window_left = -1);

// The same, synchronous: returns when the results are written; NaN/Inf in q throws.
void decode_paged(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                  float scale, int splits, cudaStream_t stream, const QueryTransform& qt = {}, int64_t window_left = -1);

}  // namespace dmattn::cuda
