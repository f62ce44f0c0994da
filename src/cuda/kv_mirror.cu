// The KV cache on the device: a mirror of a KVCache's pages in device pools (K codes, K scales, and
// V: bf16, or MX codes transposed plus their scales), kept with the cache (KVCache::device_state)
// and refreshed page by page by version, so a decode step uploads only what changed since the last
// one (the page the new tokens went into and any page re-encoded on leaving the window), then runs
// decode_paged over it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/buffers.hpp"
#include "cuda/decode.cuh"
#include "cuda/e2m1_bytes.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/quantize.hpp"
#include "problem.hpp"

namespace dmattn::cuda {

// vt_position must be a permutation of each 32-key block (the mirror writes every key once).
constexpr bool vt_position_permutes() {
  bool seen[kTile] = {};
  for (int k = 0; k < kTile; ++k) {
    const int p = vt_position(k);
    if (p < 0 || p >= kTile || p / 32 != k / 32 || seen[p]) return false;
    seen[p] = true;
  }
  return true;
}
static_assert(vt_position_permutes());

namespace {

constexpr int64_t T = kTile;

struct Mirror {
  int device = -1;
  int64_t d = 0;
  int64_t capacity = 0;            // pages the pools hold
  int64_t code_bytes = 0, scale_bytes = 0, v_bytes = 0, v8_bytes = 0, vs_bytes = 0;  // per page
  bool v4 = false;  // pv = mxfp4: v8 holds E2M1 nibbles
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  uint16_t* v = nullptr;   // pv = bf16
  uint8_t* v8 = nullptr;   // pv = mxfp8 / mxfp4: V^T codes per page and head, [d][128] (E2M1: [d][64] bytes)
  uint8_t* vs = nullptr;   // pv != bf16: V's block scales, [heads][4][d] as the host page
  uint8_t* slot = nullptr;
  std::vector<uint8_t> vt;  // pv != bf16: the changed pages' V^T, staged for upload
  std::vector<uint64_t> synced;    // page version on the device (0: never uploaded)
  std::vector<uint8_t> slot_host;

  ~Mirror() {
    cudaFree(codes);
    cudaFree(scales);
    cudaFree(v);
    cudaFree(v8);
    cudaFree(vs);
    cudaFree(slot);
  }

  // Pools for at least n pages; existing pages move along (the old pools are freed after the copy).
  void reserve(int64_t n, cudaStream_t stream) {
    if (n <= capacity) return;
    const int64_t cap = std::max<int64_t>(n, 2 * capacity);
    auto grow = [&](auto*& ptr, int64_t per_page) {
      using P = std::remove_reference_t<decltype(ptr)>;
      if (per_page == 0) return;  // not used by this cache's pv mode
      void* fresh = nullptr;
      check(cudaMalloc(&fresh, size_t(cap * per_page)), "KV cache device pool");
      if (ptr) {
        check(cudaMemcpyAsync(fresh, ptr, size_t(capacity * per_page), cudaMemcpyDeviceToDevice, stream), "KV cache pool copy");
        check(cudaStreamSynchronize(stream), "KV cache pool copy");
        cudaFree(ptr);
      }
      ptr = static_cast<P>(fresh);
    };
    grow(codes, code_bytes);
    grow(scales, scale_bytes);
    grow(v, v_bytes);
    grow(v8, v8_bytes);
    grow(vs, vs_bytes);
    grow(slot, 1);
    capacity = cap;
  }

  void sync(const KVCache& cache, cudaStream_t stream) {
    const int64_t n = cache.page_count();
    reserve(n, stream);
    synced.resize(size_t(n), 0);
    slot_host.resize(size_t(n), 0);
    auto put = [&](void* dst, const void* src, size_t bytes) {
      if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), "KV cache upload");
    };
    std::vector<int64_t> changed;
    for (int64_t id = 0; id < n; ++id)
      if (cache.page(int32_t(id)).version != synced[size_t(id)]) changed.push_back(id);
    if (changed.empty()) return;
    vt.resize(size_t(v8_bytes) * changed.size());  // empty for pv = bf16
    for (size_t i = 0; i < changed.size(); ++i) {
      const int64_t id = changed[i];
      const KVCache::Page& pg = cache.page(int32_t(id));
      put(codes + id * code_bytes, pg.codes.data(), pg.codes.size());
      put(scales + id * scale_bytes, pg.scales.data(), pg.scales.size());
      if (v) put(v + id * (v_bytes / 2), pg.v.data(), pg.v.size() * sizeof(uint16_t));
      if (v8) {  // V^T per head: the FP8 mma wants each column's keys contiguous (in fragment order)
        uint8_t* dst = vt.data() + i * size_t(v8_bytes);
        const int64_t key_row = v4 ? d / 2 : d, col_row = v4 ? T / 2 : T;  // host / device row bytes
        const int64_t heads = v8_bytes / (col_row * d);
        auto code = [&](int64_t h, int64_t k, int64_t c) { return element_code(pg.v8.data() + (h * T + k) * key_row, c, v4); };
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t c = 0; c < d; ++c) {
            uint8_t* row = dst + (h * d + c) * col_row;
            if (v4) {  // E2M1: word t of each 32-key block holds keys 8j + 2t (+1), j = 0..3, placed for f16
              for (int64_t k0 = 0; k0 < T; k0 += 32)
                for (int t = 0; t < 4; ++t) {
                  uint8_t codes[8];
                  for (int j = 0; j < 8; ++j) codes[j] = code(h, k0 + 8 * (j / 2) + 2 * t + j % 2, c);
                  const uint32_t w = e2m1x8_f16_pack(codes);
                  std::memcpy(row + k0 / 2 + 4 * t, &w, 4);  // little-endian, as the kernel loads it
                }
            } else {
              for (int64_t k = 0; k < T; ++k) row[vt_position(int(k))] = code(h, k, c);
            }
          }
        put(v8 + id * v8_bytes, dst, size_t(v8_bytes));
        put(vs + id * vs_bytes, pg.vs.data(), pg.vs.size());
      }
      slot_host[size_t(id)] = pg.format == cache.policy().high ? 0 : 1;
      synced[size_t(id)] = pg.version;
    }
    put(slot, slot_host.data(), size_t(n));
    // The host sources (vt, slot_host) are reused by the next sync: finish the copies here.
    check(cudaStreamSynchronize(stream), "KV cache upload");
  }
};

}  // namespace

void decode_attention(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                      float* lse, float scale, int splits, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (!is_device_pointer(q.data) || !is_device_pointer(out.data) || (lse && !is_device_pointer(lse)))
    throw Error("decode_attention: q, out and lse must be device memory when q is a CUDA tensor");
  const int64_t d = cache.head_dim(), Hkv = cache.kv_heads();
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::shared_ptr<void>& state = cache.device_state();
  if (!state || static_cast<Mirror*>(state.get())->device != dev) {  // first use, or another device now
    auto m = std::make_shared<Mirror>();
    m->device = dev;
    m->code_bytes = Hkv * T * d;  // 8-bit rows; E2M1 pages use the first half
    m->scale_bytes = Hkv * T * (d / 32);
    const PV pv = cache.policy().pv;
    m->v_bytes = pv == PV::bf16 ? Hkv * T * d * 2 : 0;
    m->v8_bytes = pv == PV::mxfp8 ? Hkv * T * d : pv == PV::mxfp4 ? Hkv * T * d / 2 : 0;
    m->vs_bytes = pv == PV::bf16 ? 0 : Hkv * (T / 32) * d;
    m->v4 = pv == PV::mxfp4;
    m->d = d;
    state = m;
  }
  Mirror& m = *static_cast<Mirror*>(state.get());
  m.sync(cache, stream);

  const int S = int(seqs.size());
  int max_pages = 1;
  for (int sq : seqs) max_pages = std::max<int>(max_pages, int(cache.page_table(sq).size()));
  std::vector<int32_t> table(size_t(S) * size_t(max_pages), 0);
  std::vector<int32_t> length(static_cast<size_t>(S));
  for (int i = 0; i < S; ++i) {
    const auto& t = cache.page_table(seqs[size_t(i)]);
    std::copy(t.begin(), t.end(), table.begin() + int64_t(i) * max_pages);
    length[size_t(i)] = int32_t(cache.length(seqs[size_t(i)]));
  }
  Buffers buf(stream);
  const PagedKV kv{m.codes, m.scales, m.v, m.slot, buf.upload(table.data(), table.size()),
                   buf.upload(length.data(), length.size()), S, max_pages, int(Hkv), int(d), m.v8, m.vs};
  decode_paged(kv, cache.policy(), q, out, lse, scale, splits, stream);
}

}  // namespace dmattn::cuda

namespace dmattn {

double decode_on_device(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                        float* lse, const DecodeOptions& opts) {
  cuda::require_device();
  cuda::Buffers buf;
  const size_t rows = size_t(q.shape[0] * q.shape[1] * q.shape[2]);
  const TensorView dq = buf.stage(q, "decode_on_device"), dout = buf.stage(out, "decode_on_device");
  float* dlse = lse ? buf.alloc<float>(rows * sizeof(float)) : nullptr;
  DecodeOptions o = opts;
  o.stream = nullptr;  // the default stream, which time_ms times
  const float ms = cuda::time_ms([&] { decode_attention(cache, seqs, dq, dout, dlse, o); });
  cuda::download(out.data, dout.data, size_t(out.numel()) * dtype_size(out.dtype));
  if (lse) cuda::download(lse, dlse, rows * sizeof(float));
  return ms;
}

}  // namespace dmattn
