// PagedKVCache in a build without CUDA: it lives in GPU memory, so every entry point says so.
#include "dmattn/error.hpp"
#include "dmattn/paged_kv_cache.hpp"

namespace dmattn {
namespace {
[[noreturn]] void no_cuda() {
  throw Error("PagedKVCache lives in GPU memory: this build has no CUDA backend (configure with -DDMATTN_CUDA=ON "
              "on a machine with nvcc); KVCache holds a cache in host memory");
}
}  // namespace

struct PagedKVCache::Impl {};

PagedKVCache::PagedKVCache(int64_t, int64_t, const Policy&) { no_cuda(); }
PagedKVCache::~PagedKVCache() = default;
int PagedKVCache::new_sequence() { no_cuda(); }
void PagedKVCache::free_sequence(int) { no_cuda(); }
void PagedKVCache::append(const std::vector<int>&, const TensorView&, const TensorView&, void*) { no_cuda(); }
void PagedKVCache::reserve(int64_t, int64_t) { no_cuda(); }
void PagedKVCache::prepare(const std::vector<int>&, int64_t, void*) { no_cuda(); }
int64_t PagedKVCache::length(int) const { no_cuda(); }
const std::vector<int32_t>& PagedKVCache::page_table(int) const { no_cuda(); }
int64_t PagedKVCache::kv_heads() const { no_cuda(); }
int64_t PagedKVCache::head_dim() const { no_cuda(); }
const Policy& PagedKVCache::policy() const { no_cuda(); }
int PagedKVCache::device() const { no_cuda(); }
int64_t PagedKVCache::page_bytes() const { no_cuda(); }
std::vector<uint8_t> PagedKVCache::page_records(int32_t) const { no_cuda(); }

void decode_attention(const PagedKVCache&, const std::vector<int>&, const TensorView&, const TensorView&, float*,
                      const DecodeOptions&) {
  no_cuda();
}

}  // namespace dmattn
