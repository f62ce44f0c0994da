// A paged, MX-quantized KV cache and decode attention over it (CPU; the oracle for a GPU decode).
//
// Storage: pages of 128 tokens (one key tile) x all KV heads. K lives in the page's format: the
// policy's high format for the most recent `diag_tiles` pages and the first `sink_tiles` pages,
// the low format otherwise; V in bf16 (pv = bf16) or MX in 32-key blocks per channel, MXFP8 E4M3
// (pv = mxfp8) or MXFP4 (pv = mxfp4); the open block
// at the end is re-quantized from its retained originals on every append, zero-padded as prefill
// pads past Nk, so its codes are prefill's. A page that leaves the recent window is
// re-encoded to the low format from the original K values, which the cache retains (as fp32) only
// while a page is in the window and not a sink; so every page holds exactly the codes the prefill
// path computes for that tile from the same inputs (re-encoding from the high format's values
// instead would round twice; the test measures that difference).
//
// Decode semantics (docs/DESIGN.md with the decode alignment): Nq new queries of a sequence of length L
// sit at positions L-Nq..L-1 (causal, bottom-right); key page j runs in the format it is stored in,
// i.e. the policy of the query tile of position L-1. For queries that all lie in that tile this is
// exactly the prefill definition, and decode equals the prefill path's last Nq rows. Queries that
// straddle a 128-position boundary (Nq > 1 only) use the newest tile's policy for all rows.
//
// The accuracy transforms (policy.hpp) in the cache: `rotate` stores K rotated and rotates each
// query as decode quantizes it; `smooth_k` subtracts one per-head mean fixed by the sequence's first
// append (its tokens' mean: a prompt appended whole gives prefill's mean) from every key the
// sequence holds, and decode reports LSE unshifted; `sink_keys` retains the sequence's first keys as
// they enter quantization and scores them exactly. Transformed rows (K and q) are rounded to bf16
// before quantization, as in prefill. So decode still equals prefill's last rows when the prompt
// is the first append. `smooth_q` applies to prefill only: its exact term mu.k needs unquantized
// keys, which the cache does not hold, so decode quantizes its queries unsmoothed.
// Split-KV: each split runs its pages in ascending order (online softmax), partial results merge
// by LSE; one split reproduces prefill bit for bit, more splits round P relative to each split's
// own maximum (rel. L2 ~1e-3 against one split).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "dmattn/policy.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn {

// Rows of a cache's key state per KV head, kept with each sequence's first page: 1 for smooth_k's
// mean, then one for each of the sink_keys keys (the same in KVCache and PagedKVCache).
inline int key_state_rows(const Policy& p) { return (p.smooth_k ? 1 : 0) + p.sink_keys; }

class KVCache {
 public:
  static constexpr int kMaxSinkKeys = 1024;  // sink keys a cache retains (fp32 rows a head)

  // Throws dmattn::Error for what a cache cannot hold: NVFP4 (its tensor scale needs all tokens),
  // pv = fp8 (its V scales need all tokens), head dims unsupported.
  KVCache(int64_t kv_heads, int64_t head_dim, const Policy& policy);

  int new_sequence();                  // an empty sequence's id
  void free_sequence(int seq);         // its pages return to the pool (reused by later appends)
  // Appends n tokens: k and v are [1, kv_heads, n, head_dim] views on the CPU (any float dtype).
  void append(int seq, const TensorView& k, const TensorView& v);

  int64_t length(int seq) const;
  const std::vector<int32_t>& page_table(int seq) const;  // logical page -> physical page
  // The transforms' state of a sequence, kept with its first page (Page::state): smooth_k's K mean
  // [kv_heads][d] (rotated when rotate is on) and the first min(sink_keys, length) keys as quantized
  // (transformed, rounded to bf16) [kv_heads][sink_keys][d], zeros past its length. Empty where the
  // policy has no such transform or the sequence no token yet.
  std::vector<float> key_mean(int seq) const;
  std::vector<float> sink_rows(int seq) const;
  // Rows of Page::state a head (key_state_rows).
  int state_rows() const { return key_state_rows(policy_); }
  // Bytes this sequence holds: K codes and scales, V (bf16, or MXFP8 codes and scales), retained
  // fp32 K of window pages, (pv = mxfp8) the retained fp32 V of the open 32-key block, and the
  // transforms' K mean and sink rows.
  size_t bytes(int seq) const;
  int64_t kv_heads() const { return heads_; }
  int64_t head_dim() const { return d_; }
  const Policy& policy() const { return policy_; }

  struct Page {
    Format format{};                // K's storage format now
    std::vector<uint8_t> codes;     // [heads][128][code bytes of one row]
    std::vector<uint8_t> scales;    // [heads][128][d / 32]
    std::vector<uint16_t> v;        // pv = bf16: [heads][128][d], bf16 bits
    std::vector<uint8_t> v8;        // pv = mxfp8: [heads][128][d] E4M3 codes; mxfp4: [heads][128][d / 2] E2M1
                                    // codes, two channels a byte (low nibble first)
    std::vector<uint8_t> vs;        // pv != bf16: [heads][128 / 32][d] E8M0 scales of 32-key blocks
    std::vector<float> kept;        // [heads][128][d] original K while re-encoding is ahead; else empty
    std::vector<float> state;       // a sequence's first page: [heads][state_rows()][d], the transforms' state
    uint64_t version = 0;           // bumped whenever codes, scales or V change (device copies sync by it)
  };
  const Page& page(int32_t id) const { return pages_[size_t(id)]; }
  int32_t page_count() const { return int32_t(pages_.size()); }  // physical pages, free ones included

  // The CUDA backend's copy of the pages (created by the first decode with CUDA tensors; later
  // calls upload only pages whose version changed). Opaque here: the CPU build never touches it.
  std::shared_ptr<void>& device_state() const { return device_state_; }

  // Re-encode a window page from its high-format values instead of the retained originals (the
  // alternative the header comment mentions; for measuring its effect only).
  bool reencode_from_high = false;

 private:
  struct Sequence {
    std::vector<int32_t> table;
    int64_t length = 0;
    bool live = false;
    std::vector<float> v_tail;  // pv = mxfp8: originals of the open 32-key block, [heads][32][d]
  };
  // K rows [heads][n][d] of tokens from position `pos` as they enter quantization: rotated, centred,
  // rounded (the transforms); `state` (the first page's) takes the mean (first append) and sink rows.
  void transform_keys(std::vector<float>& k, int64_t n, int64_t pos, std::vector<float>& state) const;
  void encode_values(Sequence& s, Page& pg, int64_t off, int64_t take, const float* v, int64_t n) const;
  void encode_rows(Page& pg, int64_t h, int64_t row0, int64_t rows, const float* k) const;
  void settle(Sequence& s);  // re-encode pages that left the window
  Sequence& seq(int id);
  const Sequence& seq(int id) const;

  int64_t heads_, d_;
  Policy policy_;
  std::vector<Page> pages_;
  std::vector<int32_t> free_pages_;
  std::vector<Sequence> seqs_;
  mutable std::shared_ptr<void> device_state_;
};

struct DecodeOptions {
  std::optional<float> softmax_scale;  // default 1/sqrt(d)
  // Split-KV: each sequence's pages (from the first one a row's window reaches) divided into
  // min(splits, pages) ranges. 0 = automatic: one on
  // the CPU (prefill's arithmetic exactly), on the GPU enough to give every SM work.
  int splits = 0;
  int threads = 0;                     // CPU worker threads; 0 = all
  // Sliding window: a query at position p sees keys [p - window_left, p] (decode is causal); -1 = unbounded.
  int64_t window_left = -1;
  void* stream = nullptr;              // CUDA stream (cudaStream_t) for CUDA tensors; null = default
};

// q: [S, Hq, Nq, d] view (S = seqs.size(), Hq a multiple of the cache's kv heads, 1 <= Nq <= 16,
// Nq <= each sequence's length); out likewise; lse [S, Hq, Nq] or null. q, out and lse on the CPU,
// or all on the current CUDA device (d 64, 128 or 256; the pages are mirrored on the device,
// see device_state()).
void decode_attention(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                      float* lse, const DecodeOptions& opts = {});

// decode_attention on the current CUDA device for host q / out / lse (contiguous): q staged to the
// device, out and lse copied back. Returns the decode call's device time in ms (the first call on a
// cache includes uploading its pages to the cache's device mirror; later ones upload only changes).
// Throws dmattn::Error in a build without CUDA or where no device is present.
double decode_on_device(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                        float* lse, const DecodeOptions& opts = {});

}  // namespace dmattn
