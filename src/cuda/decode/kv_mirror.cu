// The KV cache on the device: a mirror of a KVCache's pages in one device pool of records (a page's
// Hkv x 4 warp blocks, each its K codes, K scales and V laid out as the decode kernel's stage holds
// them: kv_record.hpp), kept with the cache (KVCache::device_state) and refreshed page by page by
// version, so a decode step packs and uploads only what changed since the last one (the page the new
// tokens went into and any page re-encoded on leaving the window), then runs decode_paged over it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/capabilities.hpp"
#include "cuda/common/buffers.hpp"
#include "cuda/decode/decode.cuh"
#include "cuda/ptx/e2m1_bytes.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/quantize.hpp"
#include "problem.hpp"

namespace dmattn::cuda {

namespace {
constexpr int64_t T = kTile;
}  // namespace

void pack_page(const KVCache::Page& pg, int64_t Hkv, int d, int vbits, uint8_t* dst) {
  const int64_t rb = record_bytes(d, vbits), nb = d / 32;
  const bool k4 = format_info(pg.format).elem == Elem::e2m1, v4 = vbits == 4;
  const int kr = record_k_row(d, k4);
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t w = 0; w < T / kRecordKeys; ++w) {
      uint8_t* r = dst + (h * (T / kRecordKeys) + w) * rb;
      std::memset(r, 0, size_t(record_k(d, k4)));  // the K region's unused head (E2M1 rows); every other byte is written below
      const int64_t key0 = h * T + w * kRecordKeys;  // the host page's row of the block's first key
      for (int k = 0; k < kRecordKeys; ++k)  // K rows, chunks swizzled
        for (int c = 0; c < kr / 16; ++c)
          std::memcpy(r + record_k(d, k4) + k * kr + swizzled(kr / 16, k, 16 * c), pg.codes.data() + (key0 + k) * kr + 16 * c, 16);
      std::memcpy(r + record_k_scales(d), pg.scales.data() + key0 * nb, size_t(kRecordKeys * nb));
      uint8_t* v = r + record_v(d);
      if (vbits == 16) {
        for (int k = 0; k < kRecordKeys; ++k)
          for (int c = 0; c < 2 * d / 16; ++c)
            std::memcpy(v + k * 2 * d + swizzled(2 * d / 16, k, 16 * c), pg.v.data() + (key0 + k) * d + 8 * c, 16);
        continue;
      }
      // V^T: the f16/FP8 mma wants each column's keys contiguous (in fragment order)
      const int64_t key_row = v4 ? d / 2 : d, vt_row = record_vt_row(vbits);
      auto code = [&](int k, int64_t c) { return element_code(pg.v8.data() + (key0 + k) * key_row, c, v4); };
      for (int64_t c = 0; c < d; ++c) {
        uint8_t* col = v + c * vt_row;
        if (v4) {  // E2M1: word t holds keys 8j + 2t (+1), j = 0..3, placed for f16
          for (int t = 0; t < 4; ++t) {
            uint8_t codes[8];
            for (int j = 0; j < 8; ++j) codes[j] = code(8 * (j / 2) + 2 * t + j % 2, c);
            const uint32_t word = e2m1x8_f16_pack(codes);
            std::memcpy(col + 4 * t, &word, 4);  // little-endian, as the kernel loads it
          }
        } else {
          for (int k = 0; k < kRecordKeys; ++k) col[vt_position(k)] = code(k, c);
        }
      }
      std::memcpy(v + d * vt_row, pg.vs.data() + (h * (T / kRecordKeys) + w) * d, size_t(d));
    }
}

namespace {

struct Mirror {
  int device = -1;
  int d = 0, vbits = 16;
  int64_t Hkv = 0;
  int64_t capacity = 0;   // pages the pools hold
  int64_t page_bytes = 0;  // Hkv x 4 records
  uint8_t* rec = nullptr;
  uint8_t* slot = nullptr;
  float* state = nullptr;    // [pages][Hkv][rows][d]: the transforms' state of first pages (Page::state)
  int64_t state_floats = 0;  // a page's share: Hkv x rows x d
  std::vector<uint8_t> staged;     // the changed pages' records, packed for upload
  std::vector<uint64_t> synced;    // page version on the device (0: never uploaded)
  std::vector<uint8_t> slot_host;

  ~Mirror() {
    cudaFree(rec);
    cudaFree(slot);
    cudaFree(state);
  }

  // Pools for at least n pages; existing pages move along (the old pools are freed after the copy).
  void reserve(int64_t n, cudaStream_t stream) {
    if (n <= capacity) return;
    const int64_t cap = std::max<int64_t>(n, 2 * capacity);
    auto grow = [&](uint8_t*& ptr, int64_t per_page) {
      void* fresh = nullptr;
      check(cudaMalloc(&fresh, size_t(cap * per_page)), "KV cache device pool");
      if (ptr) {
        check(cudaMemcpyAsync(fresh, ptr, size_t(capacity * per_page), cudaMemcpyDeviceToDevice, stream), "KV cache pool copy");
        check(cudaStreamSynchronize(stream), "KV cache pool copy");
        cudaFree(ptr);
      }
      ptr = static_cast<uint8_t*>(fresh);
    };
    grow(rec, page_bytes);
    grow(slot, 1);
    if (state_floats > 0) {
      uint8_t* p = reinterpret_cast<uint8_t*>(state);
      grow(p, state_floats * int64_t(sizeof(float)));
      state = reinterpret_cast<float*>(p);
    }
    capacity = cap;
  }

  void sync(const KVCache& cache, cudaStream_t stream) {
    const int64_t n = cache.page_count();
    reserve(n, stream);
    synced.resize(size_t(n), 0);
    slot_host.resize(size_t(n), 0);
    std::vector<int64_t> changed;
    for (int64_t id = 0; id < n; ++id)
      if (cache.page(int32_t(id)).version != synced[size_t(id)]) changed.push_back(id);
    if (changed.empty()) return;
    staged.resize(size_t(page_bytes) * changed.size());
    for (size_t i = 0; i < changed.size(); ++i) {
      const int64_t id = changed[i];
      const KVCache::Page& pg = cache.page(int32_t(id));
      uint8_t* dst = staged.data() + i * size_t(page_bytes);
      pack_page(pg, Hkv, d, vbits, dst);
      check(cudaMemcpyAsync(rec + id * page_bytes, dst, size_t(page_bytes), cudaMemcpyHostToDevice, stream), "KV cache upload");
      if (!pg.state.empty())
        check(cudaMemcpyAsync(state + id * state_floats, pg.state.data(), pg.state.size() * sizeof(float),
                              cudaMemcpyHostToDevice, stream), "KV cache upload");
      slot_host[size_t(id)] = pg.format == cache.policy().high ? 0 : 1;
      synced[size_t(id)] = pg.version;
    }
    check(cudaMemcpyAsync(slot, slot_host.data(), size_t(n), cudaMemcpyHostToDevice, stream), "KV cache upload");
    // The host sources (staged, slot_host) are reused by the next sync: finish the copies here.
    check(cudaStreamSynchronize(stream), "KV cache upload");
  }
};

}  // namespace

void decode_attention(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                      float* lse, float scale, const DecodeOptions& opts) {
  const cudaStream_t stream = static_cast<cudaStream_t>(opts.stream);
  if (!is_device_pointer(q.data) || !is_device_pointer(out.data) || (lse && !is_device_pointer(lse)))
    throw Error("decode_attention: q, out and lse must be device memory when q is a CUDA tensor");
  const int64_t d = cache.head_dim(), Hkv = cache.kv_heads();
  // Before the pages are mirrored: their records exist only for the decode's head dims and formats.
  require(cuda_decode_capabilities(), cache.policy(), d);
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::shared_ptr<void>& state = cache.device_state();
  if (!state || static_cast<Mirror*>(state.get())->device != dev) {  // first use, or another device now
    auto m = std::make_shared<Mirror>();
    m->device = dev;
    m->d = int(d);
    m->Hkv = Hkv;
    m->vbits = v_bits(cache.policy().pv);
    m->page_bytes = Hkv * (T / kRecordKeys) * record_bytes(int(d), m->vbits);
    m->state_floats = Hkv * cache.state_rows() * d;
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
  const PagedKV kv{m.rec, m.slot, buf.upload(table.data(), table.size()), buf.upload(length.data(), length.size()),
                   S, max_pages, int(Hkv), int(d), m.vbits};
  const Policy& pol = cache.policy();
  QueryTransform qt;
  qt.on = !pol.transforms().empty();
  qt.rotate = pol.rotate;
  qt.smooth_k = pol.smooth_k;
  qt.sink_keys = pol.sink_keys;
  qt.state = m.state;
  qt.rows = cache.state_rows();
  decode_paged(kv, pol, q, out, lse, scale, opts.splits, stream, qt, opts.window_left);
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
