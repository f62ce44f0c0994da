// A paged MX KV cache that lives in GPU memory: what a generation loop appends to and decodes from
// without host work per step beyond the launches.
//
// The pages, their formats, the page tables and the lengths are device memory; the host keeps only
// the bookkeeping it decides itself (which physical page a new token block goes to, each
// sequence's length). append() quantizes the new tokens on the GPU, straight into the record layout
// the decode kernel reads, including the re-encoding of a page that leaves the diagonal window
// (from the original keys, kept on the device while a page is in the window) and the open MX block
// of V (re-quantized from its kept originals). Every page holds, byte for byte, what KVCache holds
// after the same appends, so decode over it gives KVCache's results (the semantics are KVCache's:
// kv_cache.hpp).
//
// Work is enqueued on the caller's stream and waits for the device only when the page pool grows (an
// append that needs more pages than the pool holds: it grows 1.5x or more, once); NaN or Inf in k or v
// gives that block a NaN scale (decode then returns NaN for the rows that see it) instead of an
// error, which would need a synchronisation. Calls on one cache must be ordered on one stream (or
// ordered by the caller) and come from one host thread at a time.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dmattn/kv_cache.hpp"
#include "dmattn/policy.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn {

class PagedKVCache {
 public:
  // On the current CUDA device. Throws dmattn::Error in a build without CUDA, where no device is
  // present, or for what the device cache does not take (dmattn capabilities lists it).
  PagedKVCache(int64_t kv_heads, int64_t head_dim, const Policy& policy);
  ~PagedKVCache();
  PagedKVCache(const PagedKVCache&) = delete;
  PagedKVCache& operator=(const PagedKVCache&) = delete;

  int new_sequence();           // an empty sequence's id
  void free_sequence(int seq);  // its pages return to the pool (reused by later appends)
  // Appends n tokens to each of the sequences: k and v are [seqs.size(), kv_heads, n, head_dim] CUDA
  // views (f32, bf16 or f16, unit stride on the head dim) on this cache's device; `stream` is a
  // cudaStream_t (null: the default stream). A sequence appears at most once a call.
  void append(const std::vector<int>& seqs, const TensorView& k, const TensorView& v, void* stream = nullptr);

  // CUDA graphs. An append and a decode captured in a graph replay with the cache's device addresses
  // as they were at capture, so once a graph has captured either, the cache's memory never moves and
  // an append that would need more throws: reserve() the room first (it also makes room for the
  // plans of steps of up to 16 tokens a sequence). A captured append carries out a plan made on the
  // host: prepare(seqs, n) does the bookkeeping of an append of n tokens to each of seqs now and
  // writes its plan to device memory (stream-ordered), and a replay carries it out. The capture
  // itself carries out nothing: call prepare() once before every replay, with the sequences and
  // token count the graph captured. A replay whose plan is not the next one (a prepare() missed or
  // doubled) appends nothing, and its decode, like every decode until a replay that finds its plan,
  // returns NaN rows instead of a silently wrong answer. A sequence once prepared takes every later
  // append through prepare() and replays (an eager append to it throws: the host cannot see when a
  // replay runs). With smooth_k, a graph that captured sequences holding tokens leaves out the key
  // mean a first append fixes: prepare() then refuses an empty sequence (append its prompt eagerly).
  // A captured decode reads every sequence's whole page table (the lengths change between replays);
  // at most 896 sequences.
  void reserve(int64_t sequences, int64_t tokens);  // room for sequences [0, sequences) of `tokens` tokens each
  void prepare(const std::vector<int>& seqs, int64_t n, void* stream = nullptr);

  int64_t length(int seq) const;
  const std::vector<int32_t>& page_table(int seq) const;  // logical page -> physical page
  int64_t kv_heads() const;
  int64_t head_dim() const;
  const Policy& policy() const;
  int device() const;
  // Device bytes of one page of 128 tokens, all KV heads: K codes and scales, V in the pv format.
  // Records are sized for one byte a K code whatever the page's format, so an E2M1 page leaves its
  // K region half unused (the decode kernel copies K, scales and V as one run).
  int64_t page_bytes() const;
  // One page's bytes as the decode kernel reads them (synchronous; for tests).
  std::vector<uint8_t> page_records(int32_t page) const;

  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Decode over a PagedKVCache: q, out [S, Hq, Nq, d] CUDA views on the cache's device, lse [S*Hq*Nq]
// device floats or null; semantics and options as decode_attention over a KVCache. Enqueued on
// opts.stream without waiting for the device (q is not checked for NaN/Inf: they propagate to out).
void decode_attention(const PagedKVCache& cache, const std::vector<int>& seqs, const TensorView& q,
                      const TensorView& out, float* lse, const DecodeOptions& opts = {});

}  // namespace dmattn
