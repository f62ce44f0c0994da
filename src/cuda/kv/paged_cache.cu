// PagedKVCache (include/dmattn/paged_kv_cache.hpp): the host's bookkeeping (page allocation,
// lengths, which pages keep their original keys) and the launches that carry it out on the device
// (kv/append.cuh). An append that opens or re-encodes pages uploads one small plan through a pinned
// ring and enqueues up to three kernels (a sequence's first append with smooth_k adds its mean's two);
// a decode step's append is one launch carrying its batch in its parameters. Nothing waits for the
// device except a pool that has to grow. Under CUDA graph capture an append carries out a plan
// prepare() wrote to fixed device memory, and the pools stop moving (the graph holds their addresses).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_set>

#include "core/capabilities.hpp"
#include "cuda/common/buffers.hpp"
#include "cuda/common/head_dims.hpp"
#include "cuda/common/launch.hpp"
#include "cuda/decode/decode.cuh"
#include "cuda/kv/append.cuh"
#include "dmattn/error.hpp"
#include "dmattn/paged_kv_cache.hpp"

namespace dmattn {
namespace {

using cuda::check;
using cuda::kv::kPage;
constexpr int64_t kMaxStepTokens = 16;  // reserve()'s prepared plans: the most tokens a decode step appends (Nq)

// Pinned host staging for the small per-call arrays (plans, sequence lists), in a ring: a slot is
// refilled only once the device has read its last upload (its event), so a call waits for the device
// only when the host runs a whole ring of calls ahead.
class UploadRing {
 public:
  ~UploadRing() {
    for (Slot& s : slots_) {
      if (s.done) {
        cudaEventSynchronize(s.done);
        cudaEventDestroy(s.done);
      }
      if (s.host) cudaFreeHost(s.host);
    }
  }
  // A device copy of v: into `into` where given, else from buf's stream-ordered pool.
  const int32_t* upload(const std::vector<int32_t>& v, cuda::Buffers& buf, cudaStream_t stream, int32_t* into = nullptr) {
    Slot& s = slots_[next_];
    next_ = (next_ + 1) % slots_.size();
    if (s.done)
      check(cudaEventSynchronize(s.done), "KV cache staging");
    else
      check(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming), "cudaEventCreate");
    const size_t bytes = std::max<size_t>(v.size(), 1) * sizeof(int32_t);
    if (bytes > s.cap) {
      if (s.host) check(cudaFreeHost(s.host), "cudaFreeHost");
      s.host = nullptr;
      check(cudaMallocHost(&s.host, bytes), "cudaMallocHost");
      s.cap = bytes;
    }
    std::memcpy(s.host, v.data(), v.size() * sizeof(int32_t));
    int32_t* d = into ? into : buf.alloc<int32_t>(bytes);
    check(cudaMemcpyAsync(d, s.host, bytes, cudaMemcpyHostToDevice, stream), "KV cache staging");
    check(cudaEventRecord(s.done, stream), "cudaEventRecord");
    return d;
  }

 private:
  struct Slot {
    void* host = nullptr;
    size_t cap = 0;
    cudaEvent_t done = nullptr;
  };
  std::array<Slot, 8> slots_{};
  size_t next_ = 0;
};

// A device array of n T, grown to m (the first n kept, the rest filled with byte `fill`); waits
// for the copy, so the old array can be freed. rows/cols: a 2-D array [rows][n] widened to [rows][m].
template <class T>
void grow(T*& ptr, int64_t n, int64_t m, int fill, cudaStream_t stream, int64_t rows = 1) {
  void* fresh = nullptr;
  const size_t bytes = size_t(rows * m) * sizeof(T);
  if (cudaMalloc(&fresh, bytes) != cudaSuccess) {
    cudaGetLastError();  // not sticky: the cache stays as it was
    char msg[160];
    std::snprintf(msg, sizeof msg, "PagedKVCache: out of GPU memory growing a pool from %.2f to %.2f GiB",
                  double(size_t(rows * n) * sizeof(T)) / (1 << 30), double(bytes) / (1 << 30));
    throw Error(msg);
  }
  check(cudaMemsetAsync(fresh, fill, size_t(rows * m) * sizeof(T), stream), "KV cache device pool");
  if (ptr && n > 0) {
    check(cudaMemcpy2DAsync(fresh, size_t(m) * sizeof(T), ptr, size_t(n) * sizeof(T), size_t(n) * sizeof(T),
                            size_t(rows), cudaMemcpyDeviceToDevice, stream),
          "KV cache pool copy");
  }
  check(cudaStreamSynchronize(stream), "KV cache pool copy");
  cudaFree(ptr);
  ptr = static_cast<T*>(fresh);
}

}  // namespace

struct PagedKVCache::Impl {
  int device = 0;
  int64_t heads = 0, d = 0;
  Policy policy;
  cuda::kv::Pools pools;
  int64_t page_bytes = 0, page_cap = 0, pages_made = 0, kept_cap = 0, kept_made = 0, seq_cap = 0;
  struct Seq {
    std::vector<int32_t> table, kept;  // physical page and kept slot (-1: none) of each logical page
    int64_t length = 0;
    int64_t kept_from = 0;             // pages before it keep no keys (kept pages trail: the window's)
    int tail = 0;                      // which V tail buffer holds the open block
    bool live = false;
    bool prepared = false;             // appended to through prepare() and replays from then on
  };
  std::vector<Seq> seqs;
  std::vector<int32_t> free_pages, free_kept;
  UploadRing ring;
  // Set once a CUDA graph has captured work on this cache: the pools keep their addresses from then on.
  bool frozen = false;
  // Set once a graph has captured an append without smooth_k's key-mean pass (every captured sequence
  // held tokens, so no replay of it could be a first append): prepare() then refuses a first append.
  bool captured_without_means = false;
  // The prepared plan's device buffer (kv::kHead ints, then batch, table, meta, zero and reenc at
  // their capacities) and the epoch of the latest prepare.
  struct Prepared {
    int32_t* dev = nullptr;
    int64_t cs = 0, ct = 0, cm = 0, cz = 0, cr = 0;  // capacities: entries of each array
    int32_t epoch = 0;
    // Where batch, table, meta, zero and reenc start (ints from dev), and the buffer's ints.
    std::array<int64_t, 6> layout() const {
      const int64_t b = cuda::kv::kHead, t = b + 3 * cs, m = t + 2 * ct, z = m + 4 * cm, r = z + cz;
      return {b, t, m, z, r, r + 3 * cr};
    }
  } prep;

  ~Impl() {
    cudaFree(pools.rec);
    cudaFree(pools.slot);
    cudaFree(pools.kept_of);
    cudaFree(pools.pending);
    cudaFree(pools.kept);
    cudaFree(pools.state);
    cudaFree(pools.vtail);
    cudaFree(pools.table);
    cudaFree(pools.length);
    cudaFree(pools.gate);
    cudaFree(prep.dev);
  }

  // Pools move only while no CUDA graph holds their addresses.
  void movable(const char* what) const {
    if (frozen)
      throw Error(std::string("PagedKVCache: ") + what + " would move the cache's device memory, which a captured CUDA " +
                  "graph holds; reserve() room for every sequence and token before capturing");
  }

  Seq& seq(int id) {
    if (id < 0 || size_t(id) >= seqs.size() || !seqs[size_t(id)].live)
      throw Error("PagedKVCache: no sequence " + std::to_string(id));
    return seqs[size_t(id)];
  }

  int32_t new_page(cudaStream_t stream) {
    if (!free_pages.empty()) {
      const int32_t p = free_pages.back();
      free_pages.pop_back();
      return p;
    }
    reserve_pages(1, stream);
    return int32_t(pages_made++);
  }

  // Room for n more pages than the free list holds: the pool grows once for a whole append, to at
  // least 1.5x (the old pool and the new one coexist while it grows: 2.5x the old at the peak).
  int64_t state_floats() const { return heads * pools.srows * d; }  // a page's share of the state pool

  void reserve_pages(int64_t n, cudaStream_t stream) {
    const int64_t need = pages_made + std::max<int64_t>(0, n - int64_t(free_pages.size()));
    if (need > INT32_MAX) throw Error("PagedKVCache: more than 2^31 pages");
    if (need <= page_cap) return;
    movable("more pages");
    const int64_t cap = std::max<int64_t>({16, need, page_cap + page_cap / 2});
    grow(pools.rec, page_cap * page_bytes, cap * page_bytes, 0, stream);
    grow(pools.slot, page_cap, cap, 0, stream);
    grow(pools.kept_of, page_cap, cap, 0xFF, stream);  // -1
    grow(pools.pending, page_cap, cap, 0, stream);
    if (pools.srows > 0) grow(pools.state, page_cap * state_floats(), cap * state_floats(), 0, stream);
    page_cap = cap;
  }

  int32_t new_kept(cudaStream_t stream) {
    if (!free_kept.empty()) {
      const int32_t k = free_kept.back();
      free_kept.pop_back();
      return k;
    }
    if (kept_made == kept_cap) reserve_kept(std::max<int64_t>(4, 2 * kept_cap), stream);
    return int32_t(kept_made++);
  }
  void reserve_kept(int64_t cap, cudaStream_t stream) {  // room for cap kept slots
    if (cap <= kept_cap) return;
    movable("more window pages");
    const int64_t per = heads * kPage * d;
    grow(pools.kept, kept_cap * per, cap * per, 0, stream);
    kept_cap = cap;
  }

  struct HostPlan;
  cuda::kv::Codes codes() const;
  void check_append(const std::vector<int>& ids, int64_t n, const char* what);
  HostPlan plan(const std::vector<int>& ids, int64_t n, cudaStream_t stream);
  void launch(const cuda::kv::Plan& plan, int blocks, bool means, const TensorView& k, const TensorView& v,
              cudaStream_t stream);
  // Room in the prepared plan for any append of S sequences and n tokens: each opens at most
  // ceil(n/128) + 1 pages and re-encodes at most the diag_tiles pages its window holds.
  int64_t plan_pages(int64_t n) const { return (n + kPage - 1) / kPage + 1; }
  bool plan_fits(int64_t S, int64_t n) const {
    return prep.dev && S <= prep.cs && S * plan_pages(n) <= prep.ct && S * (plan_pages(n) + policy.diag_tiles) <= prep.cr;
  }
  void reserve_plan(int64_t S, int64_t n, cudaStream_t stream);
  cuda::kv::Plan prepared_plan(int S, int n) const;

  // Room for sequence ids below n and tables of `cols` pages.
  void reserve_sequences(int64_t n, int64_t cols, cudaStream_t stream) {
    if (cols > pools.cols) {
      movable("longer page tables");
      const int64_t c = std::max<int64_t>(cols, 2 * int64_t(pools.cols));
      if (c > INT32_MAX) throw Error("PagedKVCache: sequence too long");
      grow(pools.table, pools.cols, c, 0, stream, seq_cap);
      pools.cols = int(c);
    }
    if (n > seq_cap) {
      movable("more sequences");
      const int64_t cap = std::max<int64_t>(n, 2 * seq_cap), tail = 2 * heads * 32 * d;
      grow(pools.table, seq_cap * pools.cols, cap * pools.cols, 0, stream);
      grow(pools.length, seq_cap, cap, 0, stream);
      if (pools.vbits != 16) grow(pools.vtail, seq_cap * tail, cap * tail, 0, stream);
      seq_cap = cap;
    }
  }
};

PagedKVCache::PagedKVCache(int64_t kv_heads, int64_t head_dim, const Policy& policy) : impl_(std::make_unique<Impl>()) {
  cuda::require_device();
  if (kv_heads < 1) throw Error("PagedKVCache: kv_heads must be >= 1");
  require(cuda_kv_cache_capabilities(), policy, head_dim);
  policy.validate();
  Impl& m = *impl_;
  m.device = cuda::current_device();
  m.heads = kv_heads;
  m.d = head_dim;
  m.policy = policy;
  m.pools.Hkv = int(kv_heads);
  m.pools.d = int(head_dim);
  m.pools.vbits = cuda::v_bits(policy.pv);
  m.pools.record = cuda::record_bytes(int(head_dim), m.pools.vbits);
  m.pools.transformed = !policy.transforms().empty();
  m.pools.rotate = policy.rotate;
  m.pools.smooth_k = policy.smooth_k;
  m.pools.sink_keys = policy.sink_keys;
  m.pools.srows = key_state_rows(policy);
  m.page_bytes = kv_heads * (kPage / cuda::kRecordKeys) * m.pools.record;
  if (m.page_bytes >= (int64_t(1) << 32)) throw Error("PagedKVCache: a page's records exceed 4 GiB (too many KV heads)");
  check(cudaMalloc(&m.pools.gate, 3 * sizeof(int32_t)), "PagedKVCache");
  check(cudaMemset(m.pools.gate, 0, 3 * sizeof(int32_t)), "PagedKVCache");
}

PagedKVCache::~PagedKVCache() = default;

int PagedKVCache::new_sequence() {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.seqs.size(); ++i)
    if (!m.seqs[i].live) {
      m.seqs[i] = Impl::Seq{};
      m.seqs[i].live = true;
      return int(i);
    }
  m.seqs.emplace_back();
  m.seqs.back().live = true;
  return int(m.seqs.size() - 1);
}

void PagedKVCache::free_sequence(int id) {
  Impl& m = *impl_;
  Impl::Seq& s = m.seq(id);
  m.free_pages.insert(m.free_pages.end(), s.table.begin(), s.table.end());
  for (int32_t k : s.kept)
    if (k >= 0) m.free_kept.push_back(k);
  s = Impl::Seq{};
}

int64_t PagedKVCache::length(int seq) const { return impl_->seq(seq).length; }
const std::vector<int32_t>& PagedKVCache::page_table(int seq) const { return impl_->seq(seq).table; }
int64_t PagedKVCache::kv_heads() const { return impl_->heads; }
int64_t PagedKVCache::head_dim() const { return impl_->d; }
const Policy& PagedKVCache::policy() const { return impl_->policy; }
int PagedKVCache::device() const { return impl_->device; }
int64_t PagedKVCache::page_bytes() const { return impl_->page_bytes; }

std::vector<uint8_t> PagedKVCache::page_records(int32_t page) const {
  const Impl& m = *impl_;
  if (page < 0 || page >= m.pages_made) throw Error("PagedKVCache: no page " + std::to_string(page));
  std::vector<uint8_t> out(size_t(m.page_bytes));
  check(cudaDeviceSynchronize(), "PagedKVCache::page_records");
  cuda::download(out.data(), m.pools.rec + page * m.page_bytes, out.size());
  return out;
}

namespace {
void require_on(const PagedKVCache& c, const TensorView& t, const char* what, const char* name) {
  if (t.device != Device::cuda || !cuda::is_device_pointer(t.data))
    throw Error(std::string(what) + ": " + name + " must be a CUDA tensor (the cache lives in GPU memory)");
  if (t.stride[3] != 1) throw Error(std::string(what) + ": " + name + " needs unit stride on the head dim");
  if (cuda::current_device() != c.device())
    throw Error(std::string(what) + ": the current CUDA device is not the cache's (device " + std::to_string(c.device()) + ")");
}
}  // namespace

namespace {
// Whether work enqueued on `stream` is being captured into a CUDA graph.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &st), "cudaStreamIsCapturing");
  return st != cudaStreamCaptureStatusNone;
}
}  // namespace

// An append's decisions, Plan's arrays on the host: the bookkeeping done (pages opened, lengths
// advanced) as the device will carry it out.
struct PagedKVCache::Impl::HostPlan {
  std::vector<int32_t> batch, table, meta, zero, reenc;
  int blocks = 0;      // V blocks the longest-reaching sequence touches
  bool first = false;  // some sequence's first append
};

// The element types an append writes (the policy's K formats, V's pv format) and its new tokens.
cuda::kv::Codes PagedKVCache::Impl::codes() const {
  return cuda::kv::Codes{format_info(policy.high).elem, format_info(policy.low).elem,
                         pools.vbits == 16 ? Elem::e4m3 : format_info(pv_values_format(policy.pv)).elem, policy.scale_rule};
}
namespace {
template <class T>  // kt: k's data as its element type
cuda::kv::NewTokens<T> new_tokens(const T* kt, const TensorView& k, const TensorView& v, int E) {
  return cuda::kv::NewTokens<T>{kt, static_cast<const T*>(v.data), k.stride[0], k.stride[1], k.stride[2], v.stride[0],
                                v.stride[1], v.stride[2], cuda::vector_rows(k, E) && cuda::vector_rows(v, E)};
}
}  // namespace

void PagedKVCache::Impl::check_append(const std::vector<int>& ids, int64_t n, const char* what) {
  std::unordered_set<int> seen;
  for (int id : ids) {
    if (seq(id).length + n > INT32_MAX - kPage) throw Error(std::string(what) + ": sequence too long");
    if (!seen.insert(id).second) throw Error(std::string(what) + ": sequence " + std::to_string(id) + " appears twice");
  }
}

PagedKVCache::Impl::HostPlan PagedKVCache::Impl::plan(const std::vector<int>& ids, int64_t n, cudaStream_t stream) {
  int64_t cols = 0;
  for (int id : ids) cols = std::max<int64_t>(cols, (seq(id).length + n + kPage - 1) / kPage);
  reserve_sequences(int64_t(*std::max_element(ids.begin(), ids.end())) + 1, cols, stream);
  int64_t fresh = 0;  // pages this append opens
  for (int id : ids) fresh += (seq(id).length + n + kPage - 1) / kPage - int64_t(seq(id).table.size());
  reserve_pages(fresh, stream);
  if (policy.high != policy.low) {  // the kept slots the new window pages take, before any bookkeeping changes
    int64_t kept = 0;
    for (int id : ids) {
      const int64_t last = (seq(id).length + n - 1) / kPage;
      for (int64_t j = int64_t(seq(id).table.size()); j <= last; ++j) kept += policy.is_high(last, j) && j >= policy.sink_tiles;
    }
    reserve_kept(kept_made + std::max<int64_t>(0, kept - int64_t(free_kept.size())), stream);
  }

  HostPlan hp;
  std::vector<int32_t> released;  // kept slots free once the re-encoding is enqueued
  const Policy& pol = policy;
  for (int id : ids) {
    Seq& s = seq(id);
    const int64_t pos0 = s.length, end = pos0 + n, last = (end - 1) / kPage;
    hp.first |= pos0 == 0;
    hp.batch.insert(hp.batch.end(), {id, int32_t(pos0), s.tail});
    hp.blocks = std::max<int>(hp.blocks, int((end - 1) / 32 - pos0 / 32 + 1));
    s.tail = cuda::kv::next_tail(s.tail, pos0, end);
    // Pages that leave the window: re-encoded from their kept keys (the new rows join them first).
    for (size_t j = size_t(s.kept_from); j < s.table.size(); ++j)
      if (s.kept[j] >= 0 && !pol.is_high(last, int64_t(j))) {
        hp.meta.insert(hp.meta.end(), {s.table[j], 1, s.kept[j], 1});
        hp.reenc.insert(hp.reenc.end(), {s.table[j], s.kept[j], int32_t(std::min<int64_t>(kPage, end - int64_t(j) * kPage))});
        released.push_back(s.kept[j]);
        s.kept[j] = -1;
      }
    // New pages, each in the format it has at the end of this append; the keys of a high page
    // that will leave the window are kept for its re-encoding.
    for (int64_t j = int64_t(s.table.size()); j <= last; ++j) {
      const int32_t page = new_page(stream);
      const bool high = pol.is_high(last, j);
      const int32_t kslot = high && j >= pol.sink_tiles && pol.high != pol.low ? new_kept(stream) : -1;
      hp.meta.insert(hp.meta.end(), {page, high ? 0 : 1, kslot, 0});
      hp.zero.push_back((j + 1) * kPage <= end ? -1 - page : page);  // a page this append fills: its state alone
      hp.table.insert(hp.table.end(), {int32_t(int64_t(id) * pools.cols + j), page});
      s.table.push_back(page);
      s.kept.push_back(kslot);
    }
    while (s.kept_from < int64_t(s.kept.size()) && s.kept[size_t(s.kept_from)] < 0) ++s.kept_from;
    s.length = end;
  }
  free_kept.insert(free_kept.end(), released.begin(), released.end());
  return hp;
}

// The general append's launches for a plan on the device (eager: its counts; prepared: its
// capacities, the counts read on the device). blocks: V blocks a sequence touches at most; means:
// launch smooth_k's key means (they skip every sequence not at its first append).
void PagedKVCache::Impl::launch(const cuda::kv::Plan& plan, int blocks, bool means, const TensorView& k,
                                const TensorView& v, cudaStream_t stream) {
  const cuda::kv::Pools& p = pools;
  const Policy& pol = policy;
  const cuda::kv::Codes cd = codes();
  const int64_t S = plan.S, n = plan.n;
  cuda::Buffers buf(stream);
  // The launches in series, each after the first its predecessor's programmatic dependent (its CTAs
  // placed while the predecessor finishes; every kernel waits for it before reading).
  bool follows = false;
  auto chained = [&](auto kernel, int64_t blocks, const char* what, auto&&... args) {
    cuda::launch_kernel(kernel, dim3(unsigned(blocks)), dim3(256), 0, stream, follows, what, args...);
    follows = true;
  };
  auto grid = [](int64_t warps) { return std::max<int64_t>(1, (warps * 32 + 255) / 256); };
  // One thread an item of the plan's largest list, at most 1024 blocks.
  // (A prepared plan's launch is sized for its capacity and mostly finds nothing to zero: two blocks an SM.)
  const int64_t items = std::max<int64_t>({int64_t(plan.nt), plan.S, plan.nm, plan.nz * (page_bytes / 16)});
  chained(cuda::kv::apply_plan, std::clamp<int64_t>((items + 255) / 256, 1, plan.head ? 264 : 1024), "KV cache append", p,
          plan, page_bytes);
  cuda::with_head_dim(cuda::DecodeHeadDims{}, d, "PagedKVCache", [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    with_typed(k, [&](auto* kt) {
      using T = std::remove_pointer_t<decltype(kt)>;
      const cuda::kv::NewTokens<T> x = new_tokens(kt, k, v, D / 32);
      // The V blocks (pv MX) ride the key mean's launch where there is one (key_mean_parts says why).
      const bool values_with_mean = p.smooth_k && means && p.vbits != 16;
      if (p.smooth_k && means) {  // the first append of some sequence fixes its keys' mean
        const int chunks = int((n + cuda::kv::kMeanRows - 1) / cuda::kv::kMeanRows);
        double* part = buf.alloc<double>(size_t(S * heads * chunks * D) * sizeof(double));
        if (values_with_mean)
          chained(cuda::kv::key_mean_parts<D, T, true>, grid(S * heads * chunks + cuda::kv::value_warps(p, S, blocks)),
                  "KV cache key mean", p, plan, x, chunks, part, cd, blocks);
        else
          chained(cuda::kv::key_mean_parts<D, T, false>, grid(S * heads * chunks), "KV cache key mean", p, plan, x, chunks,
                  part, cd, blocks);
        chained(cuda::kv::key_mean_finish<D>, (S * heads * D + 255) / 256, "KV cache key mean", p, plan, chunks,
                static_cast<const double*>(part));
      }
      // The re-encoding's warps stride over its pages (a prepared plan's: its capacity). With one
      // token a sequence it runs in the writer's launch (append_items says why), else after it.
      const int64_t items = cuda::kv::item_warps(p, S, n, blocks, !values_with_mean);
      const int64_t reenc = std::min<int64_t>(int64_t(plan.nr) * heads * kPage, int64_t(heads) * kPage);
      const bool together = n == 1 && reenc > 0;
      chained(cuda::kv::append_items<D, T>, grid(together ? std::max(items, reenc) : items), "KV cache append", p, plan,
              x, cd, blocks, !values_with_mean, together);
      if (reenc > 0 && !together)
        chained(cuda::kv::reencode_pages<D>, grid(reenc), "KV cache re-encode", p, plan, cd.low, pol.scale_rule);
    });
  });
}

void PagedKVCache::append(const std::vector<int>& ids, const TensorView& k, const TensorView& v, void* stream_ptr) {
  Impl& m = *impl_;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const char* what = "PagedKVCache::append";
  require_on(*this, k, what, "k");
  require_on(*this, v, what, "v");
  const int64_t S = int64_t(ids.size());
  for (const TensorView* t : {&k, &v})
    if (t->shape[0] != S || t->shape[1] != m.heads || t->shape[3] != m.d)
      throw Error(std::string(what) + ": k and v must be [" + std::to_string(S) + " sequences, " +
                  std::to_string(m.heads) + ", n, " + std::to_string(m.d) + "]");
  if (k.shape[2] != v.shape[2]) throw Error(std::string(what) + ": k and v hold different token counts");
  if (k.dtype != v.dtype) throw Error(std::string(what) + ": k and v must have one dtype");
  const int64_t n = k.shape[2];
  m.check_append(ids, n, what);
  if (n == 0 || S == 0) return;
  const bool graph = capturing(stream);
  for (int id : ids)  // the host cannot see a replay: an eager append there would race the plans it carries out
    if (!graph && m.seq(id).prepared)
      throw Error(std::string(what) + ": sequence " + std::to_string(id) + " takes its appends through prepare() " +
                  "and a CUDA graph's replays; append to it that way (or free it)");
  if (graph) {  // a CUDA graph's append: each replay carries out the plan prepare() left in device memory
    if (!m.plan_fits(S, n))
      throw Error(std::string(what) + ": under CUDA graph capture the cache needs reserve() first (room for " +
                  std::to_string(S) + " sequences' plans of " + std::to_string(n) + " tokens)");
    m.frozen = true;
    // smooth_k's key mean runs in a sequence's first append only: a graph over sequences that all hold
    // tokens leaves its two launches out of every replay (prepare() refuses a first append from then on).
    const bool means = m.policy.smooth_k && std::any_of(ids.begin(), ids.end(), [&](int id) { return m.seq(id).length == 0; });
    m.captured_without_means |= m.policy.smooth_k && !means;
    m.launch(m.prepared_plan(int(S), int(n)), int((n + 30) / 32 + 1), means, k, v, stream);
    return;
  }
  Impl::HostPlan hp = m.plan(ids, n, stream);
  const cuda::kv::Pools& p = m.pools;
  if (hp.table.empty() && hp.meta.empty() && S <= cuda::kv::kStepSeqs) {  // no page opens or leaves the window
    cuda::with_head_dim(cuda::DecodeHeadDims{}, m.d, "PagedKVCache", [&](auto dc) {
      constexpr int D = decltype(dc)::value;
      with_typed(k, [&](auto* kt) {
        using T = std::remove_pointer_t<decltype(kt)>;
        cuda::kv::StepArgs<T> a{p, new_tokens(kt, k, v, D / 32), m.codes(), int(S), int(n), hp.blocks, {}};
        std::copy(hp.batch.begin(), hp.batch.end(), a.batch);
        const int64_t threads = std::max<int64_t>(cuda::kv::item_warps(p, S, n, hp.blocks) * 32, S);
        cuda::kv::append_step<D, T><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(a);
      });
    });
    check(cudaGetLastError(), "KV cache append");
    return;
  }
  cuda::Buffers buf(stream);
  std::vector<int32_t> all;
  auto put = [&](const std::vector<int32_t>& x) {
    const size_t at = all.size();
    all.insert(all.end(), x.begin(), x.end());
    return at;
  };
  const size_t ob = put(hp.batch), ot = put(hp.table), om = put(hp.meta), oz = put(hp.zero), orr = put(hp.reenc);
  const int32_t* dev = m.ring.upload(all, buf, stream);
  const cuda::kv::Plan plan{dev + ob, dev + ot, dev + om, dev + oz, dev + orr, int(S), int(n),
                            int(hp.table.size() / 2), int(hp.meta.size() / 4), int(hp.zero.size()), int(hp.reenc.size() / 3)};
  m.launch(plan, hp.blocks, hp.first, k, v, stream);
}

cuda::kv::Plan PagedKVCache::Impl::prepared_plan(int S, int n) const {
  const std::array<int64_t, 6> at = prep.layout();
  const int32_t* h = prep.dev;
  return cuda::kv::Plan{h + at[0], h + at[1], h + at[2], h + at[3], h + at[4], S, n, int(prep.ct), int(prep.cm),
                        int(prep.cz), int(prep.cr), h};
}

void PagedKVCache::Impl::reserve_plan(int64_t S, int64_t n, cudaStream_t stream) {
  if (plan_fits(S, n)) return;
  movable("a larger prepared plan");
  Prepared grown = prep;
  grown.cs = std::max(S, prep.cs);
  grown.ct = grown.cz = std::max(grown.cs * plan_pages(n), prep.ct);
  grown.cr = std::max(grown.cs * (plan_pages(n) + policy.diag_tiles), prep.cr);
  grown.cm = grown.ct + grown.cr;
  const size_t bytes = size_t(grown.layout()[5]) * sizeof(int32_t);
  void* fresh = nullptr;
  if (cudaMalloc(&fresh, bytes) != cudaSuccess) {
    cudaGetLastError();
    throw Error("PagedKVCache: out of GPU memory for a prepared plan");
  }
  check(cudaMemset(fresh, 0, bytes), "PagedKVCache");
  check(cudaStreamSynchronize(stream), "PagedKVCache");  // the old plan is no longer read
  cudaFree(prep.dev);
  grown.dev = static_cast<int32_t*>(fresh);
  prep = grown;
}

void PagedKVCache::prepare(const std::vector<int>& ids, int64_t n, void* stream_ptr) {
  Impl& m = *impl_;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const char* what = "PagedKVCache::prepare";
  if (ids.empty() || n < 1) throw Error(std::string(what) + ": at least one sequence and one token");
  if (capturing(stream)) throw Error(std::string(what) + ": runs on the host before a replay, not under capture");
  m.check_append(ids, n, what);
  if (m.captured_without_means)
    for (int id : ids)
      if (m.seq(id).length == 0)
        throw Error(std::string(what) + ": sequence " + std::to_string(id) + " is empty, and its first append fixes " +
                    "smooth_k's key mean, a pass the captured graph left out (it captured sequences that held " +
                    "tokens): append its prompt with append(), then prepare() its steps");
  const int64_t S = int64_t(ids.size());
  m.reserve_plan(S, n, stream);
  Impl::HostPlan hp = m.plan(ids, n, stream);
  for (int id : ids) m.seq(id).prepared = true;
  Impl::Prepared& pr = m.prep;
  const int64_t nt = int64_t(hp.table.size() / 2), nm = int64_t(hp.meta.size() / 4), nz = int64_t(hp.zero.size()),
                nr = int64_t(hp.reenc.size() / 3);
  if (nt > pr.ct || nm > pr.cm || nz > pr.cz || nr > pr.cr) throw Error(std::string(what) + ": internal: the plan exceeds its bound");
  ++pr.epoch;
  const std::array<int64_t, 6> at = pr.layout();
  std::vector<int32_t> all(size_t(at[5]), 0);
  const int32_t head[cuda::kv::kHead] = {pr.epoch, int32_t(S), int32_t(n), int32_t(nt), int32_t(nm), int32_t(nz), int32_t(nr)};
  std::copy(head, head + cuda::kv::kHead, all.begin());
  const std::vector<int32_t>* arrays[5] = {&hp.batch, &hp.table, &hp.meta, &hp.zero, &hp.reenc};
  for (int i = 0; i < 5; ++i) std::copy(arrays[i]->begin(), arrays[i]->end(), all.begin() + std::ptrdiff_t(at[size_t(i)]));
  cuda::Buffers buf(stream);
  m.ring.upload(all, buf, stream, pr.dev);
}

void PagedKVCache::reserve(int64_t sequences, int64_t tokens) {
  Impl& m = *impl_;
  if (sequences < 1 || tokens < 1) throw Error("PagedKVCache::reserve: at least one sequence and one token");
  const int64_t cols = (tokens + kPage - 1) / kPage;
  if (sequences * cols > INT32_MAX) throw Error("PagedKVCache::reserve: more than 2^31 pages");
  m.reserve_sequences(sequences, cols, nullptr);
  m.reserve_pages(sequences * cols - m.pages_made + int64_t(m.free_pages.size()), nullptr);
  const Policy& pol = m.policy;
  if (pol.high != pol.low) {  // window pages keep their keys: diag_tiles a sequence, one more while a page opens
    m.reserve_kept(sequences * (int64_t(pol.diag_tiles) + 1), nullptr);
  }
  m.reserve_plan(sequences, kMaxStepTokens, nullptr);  // a step's plan: up to 16 tokens a sequence (decode's Nq)
}

void decode_attention(const PagedKVCache& cache, const std::vector<int>& seqs, const TensorView& q,
                      const TensorView& out, float* lse, const DecodeOptions& opts) {
  PagedKVCache::Impl& m = cache.impl();
  const cudaStream_t stream = static_cast<cudaStream_t>(opts.stream);
  const char* what = "decode_attention";
  require_on(cache, q, what, "q");
  require_on(cache, out, what, "out");
  if (lse && !cuda::is_device_pointer(lse)) throw Error("decode_attention: lse must be device memory");
  const int64_t S = int64_t(seqs.size()), Nq = q.shape[2];
  if (S == 0) return;
  if (Nq < 1 || Nq > 16) throw Error("decode_attention: 1 to 16 new queries per sequence (got " + std::to_string(Nq) + ")");
  if (opts.splits < 0) throw Error("decode_attention: splits must be >= 0 (0 = automatic)");
  int64_t max_pages = 1;
  for (int id : seqs) {
    const PagedKVCache::Impl::Seq& s = m.seq(id);
    if (s.length < Nq)
      throw Error("decode_attention: sequence " + std::to_string(id) + " holds " + std::to_string(s.length) +
                  " tokens, fewer than the " + std::to_string(Nq) + " queries (append their keys first)");
    max_pages = std::max<int64_t>(max_pages, int64_t(s.table.size()));
  }
  const float scale = opts.softmax_scale.value_or(1.0f / std::sqrt(float(m.d)));
  if (!(scale > 0.0f && std::isfinite(scale))) throw Error("decode_attention: softmax_scale must be positive and finite");
  // A captured decode replays at later lengths: it reads every table column.
  const bool graph = capturing(stream);
  if (graph) {
    if (S > cuda::kv::kGatherIds)
      throw Error("decode_attention: under CUDA graph capture at most " + std::to_string(cuda::kv::kGatherIds) + " sequences");
    m.frozen = true;
    max_pages = std::max<int64_t>(1, m.pools.cols);
  }
  // Sequences 0 .. S-1 in that order (a batch as it was added) read the cache's own table rows and
  // lengths; any other selection is gathered into call order first.
  bool in_order = true;
  for (int64_t i = 0; i < S; ++i) in_order &= seqs[size_t(i)] == i;
  cuda::Buffers buf(stream);
  cuda::PagedKV kv{m.pools.rec, m.pools.slot, m.pools.table, m.pools.length, int(S), int(max_pages), int(m.heads), int(m.d),
                   m.pools.vbits, m.pools.cols, m.pools.gate};
  cuda::kv::Gather g{m.pools.table, m.pools.length, m.pools.cols, int(S), int(max_pages), nullptr, nullptr, nullptr, {}};
  int* nonfinite = nullptr;  // written on NaN/Inf in q, not read: no synchronisation
  auto carve = [&](uintptr_t base) {  // the gathered tables and lengths and the flag: one allocation
    cuda::Carve c(base);
    if (!in_order) {
      g.out_table = c.take<int32_t>(size_t(S * max_pages) * sizeof(int32_t));
      g.out_length = c.take<int32_t>(size_t(S) * sizeof(int32_t));
    }
    nonfinite = c.take<int>(sizeof(int));
    return c.size();
  };
  carve(reinterpret_cast<uintptr_t>(buf.alloc<uint8_t>(carve(0))));
  if (!in_order) {
    if (S <= cuda::kv::kGatherIds)
      std::copy(seqs.begin(), seqs.end(), g.ids);
    else
      g.seqs = m.ring.upload(std::vector<int32_t>(seqs.begin(), seqs.end()), buf, stream);
    cuda::kv::gather_tables<<<unsigned((S * max_pages + 255) / 256), 256, 0, stream>>>(g);
    check(cudaGetLastError(), "decode table gather");
    kv.table = g.out_table;
    kv.length = g.out_length;
    kv.stride = 0;
  }
  cuda::QueryTransform qt;  // the query side of the transforms, over the state at each sequence's first page
  qt.on = m.pools.transformed;
  qt.rotate = m.pools.rotate;
  qt.smooth_k = m.pools.smooth_k;
  qt.sink_keys = m.pools.sink_keys;
  qt.state = m.pools.state;
  qt.rows = m.pools.srows;
  cuda::decode_paged_async(kv, m.policy, q, out, lse, scale, opts.splits, nonfinite, stream, qt, opts.window_left);
}

}  // namespace dmattn
