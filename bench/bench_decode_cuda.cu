// Decode step over an MX KV cache on the GPU (the dmattn side of the decode comparison): B sequences of
// `ctx` tokens, Hq=32, Hkv=8, d=128, one new query each, the default policy (the newest page in
// MXFP8 E4M3, every other page MXFP4; V bf16). The pages are filled on the device with random
// valid codes (the kernel's time does not depend on the values; building 64 x 128k tokens through
// the host cache would take minutes). Times decode_paged_async (q's quantization, the kernel, the
// split merge) with CUDA events, and the synchronous call (with its NaN check) on the wall clock.
// Bytes read = every page's K codes + scales + V, plus q and out. Ceilings, same run: a device copy
// (read + write bytes) and a read-only pass over 2 GiB.
// Prints one line per configuration: "dmattn-<pv> B ctx us_async us_sync GB/s bytes". DMATTN_BENCH_COLD=1: each
// asynchronous step timed alone with L2 evicted first (the synchronous figure stays warm).
//
// "bench_decode_cuda fill PV B CTX" times the other half of a generation's start instead: fill_bench below;
// "bench_decode_cuda step PV B CTX" a generation's step over the KV cache in GPU memory: step_bench below.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common/buffers.hpp"
#include "cuda/decode/decode.cuh"
#include "dmattn/paged_kv_cache.hpp"

using namespace dmattn;
using dmattn::cuda::PagedKV;
using dmattn::cuda::decode_paged;
using dmattn::cuda::decode_paged_async;

#define CK(x)                                                          \
  do {                                                                 \
    cudaError_t e_ = (x);                                              \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));    \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

// Device ms of work() (enqueued on the default stream), timed by events from an idle device.
template <class F>
float idle_ms(F&& work) {
  CK(cudaDeviceSynchronize());
  return dmattn::cuda::time_ms(work);
}

__device__ uint32_t mix(uint64_t i) {
  i ^= i >> 33;
  i *= 0xff51afd7ed558ccdull;
  i ^= i >> 33;
  return uint32_t(i);
}

// A bf16 value in [-1, 1) for index i.
__device__ uint16_t bf16_at(size_t i) {
  const uint32_t r = mix(i);
  return uint16_t((r & 0x8000) | (0x3C00 + (r >> 16) % 0x380));
}
__global__ void fill_bf16(uint16_t* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = bf16_at(i);
}

// Records (cuda/kv_record.hpp) of n bytes, each byte by the region it is in: code bytes (E2M1
// nibbles any, E4M3 bytes masked off NaN), E8M0 scales near 2^0, or bf16 V (bf16_at).
__global__ void fill(uint8_t* p, size_t n, int d, int vbits) {
  using namespace dmattn::cuda;
  const size_t rb = size_t(record_bytes(d, vbits));
  const uint32_t ks = uint32_t(record_k_scales(d)), v = uint32_t(record_v(d)), vsc = v + uint32_t(d * record_vt_row(vbits));
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t r = mix(i * 3 + 1), o = uint32_t(i % rb);
    if ((o >= ks && o < v) || (vbits != 16 && o >= vsc))
      p[i] = uint8_t(122 + r % 8);
    else if (vbits == 16 && o >= v)  // records and V start at even bytes: i / 2 is the bf16's index
      p[i] = uint8_t(bf16_at(i / 2) >> (8 * (i % 2)));
    else
      p[i] = uint8_t(r & 0xF7);
  }
}

// Read-only ceiling: every byte of a buffer loaded once (16-byte loads), folded into one word per
// thread so the loads cannot be dropped. Decode only reads; a copy's figure counts reads and writes.
__global__ void read_all(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u) *sink = x;  // practically never taken
}

// A prompt appended to the KV cache in GPU memory, as a generation's prefill fills it: B sequences of
// ctx new tokens (bf16 K and V [B, 8, ctx, 128] on the device) appended whole into a new PagedKVCache
// under the default policy with V in pv: once with the pool's growth (a fresh cache's first append pays
// it), once into a cache that reserve()d the room first, as a server sizes its pool ahead (a small
// append first loads the kernels). The ceiling, same run: a device copy of the same K and V bytes.
// Medians of five. Prints "fill-<pv> B ctx ms copy_ms ratio" and the same for "fill-reserved-<pv>".
int fill_bench(const std::string& pv_arg, int B, int ctx) {
  const int Hkv = 8, d = 128;
  const size_t n = size_t(B) * Hkv * ctx * d;
  uint16_t *k, *v, *copy;
  CK(cudaMalloc(&k, n * 2));
  CK(cudaMalloc(&v, n * 2));
  CK(cudaMalloc(&copy, n * 4));
  fill_bf16<<<4096, 256>>>(k, n);
  fill_bf16<<<4096, 256>>>(v, n);
  const TensorView tk = TensorView::contiguous(k, DType::bf16, {B, Hkv, ctx, d}, Device::cuda);
  const TensorView tv = TensorView::contiguous(v, DType::bf16, {B, Hkv, ctx, d}, Device::cuda);
  Policy pol;
  pol.pv = parse_pv(pv_arg);
  auto sequences = [&](PagedKVCache& c) {
    std::vector<int> ids;
    for (int b = 0; b < B; ++b) ids.push_back(c.new_sequence());
    return ids;
  };
  {
    PagedKVCache warm(Hkv, d, pol);
    warm.append(sequences(warm), slice_tokens(tk, 0, std::min(ctx, 300)), slice_tokens(tv, 0, std::min(ctx, 300)));
  }
  std::vector<float> fills, reserved, copies;
  for (int r = 0; r < 5; ++r) {
    PagedKVCache c(Hkv, d, pol);
    const std::vector<int> ids = sequences(c);
    fills.push_back(idle_ms([&] { c.append(ids, tk, tv); }));
    PagedKVCache room(Hkv, d, pol);
    const std::vector<int> room_ids = sequences(room);
    room.reserve(B, ctx);
    reserved.push_back(idle_ms([&] { room.append(room_ids, tk, tv); }));
    copies.push_back(idle_ms([&] {
      cudaMemcpyAsync(copy, k, n * 2, cudaMemcpyDeviceToDevice);
      cudaMemcpyAsync(copy + n, v, n * 2, cudaMemcpyDeviceToDevice);
    }));
  }
  std::sort(fills.begin(), fills.end());
  std::sort(reserved.begin(), reserved.end());
  std::sort(copies.begin(), copies.end());
  std::printf("fill-%s %d %d %.3f %.3f %.2f\n", pv_arg.c_str(), B, ctx, fills[2], copies[2], fills[2] / copies[2]);
  std::printf("fill-reserved-%s %d %d %.3f %.3f %.2f\n", pv_arg.c_str(), B, ctx, reserved[2], copies[2],
              reserved[2] / copies[2]);
  cudaFree(k);
  cudaFree(v);
  cudaFree(copy);
  return 0;
}

// A generation's decode step as it runs over the KV cache in GPU memory: B sequences of ctx tokens
// (filled as a prompt), then each step appends one token a sequence and decodes one query a sequence (Hq 32, Hkv 8, d 128, the default
// policy with V in pv). Appends alone, decodes alone and whole steps, each timed over 64 back-to-back
// launches (events; a generation loop issues them so; a page opens every 128 steps, as in a generation),
// medians of five such runs. Prints
// "step-<pv> B ctx append_us decode_us step_us".
int step_bench(const std::string& pv_arg, int B, int ctx) {
  const int Hq = 32, Hkv = 8, d = 128, steps = 64;
  const int64_t prompt = ctx;
  const size_t n = size_t(B) * Hkv * prompt * d, nt = size_t(B) * Hkv * steps * d, nq = size_t(B) * Hq * d;
  uint16_t *k, *v, *tk, *tv, *q, *out;
  const std::pair<uint16_t**, size_t> arrays[] = {{&k, n}, {&v, n}, {&tk, nt}, {&tv, nt}, {&q, nq}, {&out, nq}};
  for (const auto& [ptr, count] : arrays) {
    CK(cudaMalloc(ptr, count * 2));
    fill_bf16<<<1024, 256>>>(*ptr, count);
  }
  Policy pol;
  pol.pv = parse_pv(pv_arg);
  PagedKVCache c(Hkv, d, pol);
  std::vector<int> ids;
  for (int b = 0; b < B; ++b) ids.push_back(c.new_sequence());
  c.reserve(B, prompt + 11 * steps);
  c.append(ids, TensorView::contiguous(k, DType::bf16, {B, Hkv, prompt, d}, Device::cuda),
           TensorView::contiguous(v, DType::bf16, {B, Hkv, prompt, d}, Device::cuda));
  const TensorView qv = TensorView::contiguous(q, DType::bf16, {B, Hq, 1, d}, Device::cuda);
  const TensorView ov = TensorView::contiguous(out, DType::bf16, {B, Hq, 1, d}, Device::cuda);
  const TensorView kall = TensorView::contiguous(tk, DType::bf16, {B, Hkv, steps, d}, Device::cuda);
  const TensorView vall = TensorView::contiguous(tv, DType::bf16, {B, Hkv, steps, d}, Device::cuda);
  auto append = [&](int t) { c.append(ids, slice_tokens(kall, t, 1), slice_tokens(vall, t, 1)); };
  auto decode = [&] { decode_attention(c, ids, qv, ov, nullptr); };
  auto per_launch_us = [&](auto&& work) {  // 64 in a row, µs each
    return 1000.0f * idle_ms([&] {
      for (int t = 0; t < steps; ++t) work(t);
    }) / steps;
  };
  decode();  // loads the kernels
  std::vector<float> appends, decodes, whole;
  for (int r = 0; r < 5; ++r) {  // each run appends 2 x 64 tokens a sequence, 640 in all: within the room reserved
    appends.push_back(per_launch_us(append));
    decodes.push_back(per_launch_us([&](int) { decode(); }));
    whole.push_back(per_launch_us([&](int t) {
      append(t);
      decode();
    }));
  }
  for (auto* x : {&appends, &decodes, &whole}) std::sort(x->begin(), x->end());
  std::printf("step-%s %d %d %.2f %.2f %.2f\n", pv_arg.c_str(), B, ctx, appends[2], decodes[2], whole[2]);
  for (uint16_t* p : {k, v, tk, tv, q, out}) cudaFree(p);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "fill") {
    // usage: bench_decode_cuda fill [bf16|mxfp8|mxfp4] [B] [ctx]
    return fill_bench(argc > 2 ? argv[2] : "mxfp4", argc > 3 ? std::atoi(argv[3]) : 16, argc > 4 ? std::atoi(argv[4]) : 32768);
  }
  if (argc > 1 && std::string(argv[1]) == "step") {
    // usage: bench_decode_cuda step [bf16|mxfp8|mxfp4] [B] [ctx]
    return step_bench(argc > 2 ? argv[2] : "mxfp4", argc > 3 ? std::atoi(argv[3]) : 16, argc > 4 ? std::atoi(argv[4]) : 32768);
  }
  const int Hq = 32, Hkv = 8, d = 128, T = 128;
  // usage: bench_decode_cuda [bf16|mxfp8|mxfp4 (V's format, pv)] [B] [ctx] [splits (0: the plan's)]
  const std::string pv_arg = argc > 1 ? argv[1] : "bf16";
  const PV pv = parse_pv(pv_arg);
  const int vbits = dmattn::cuda::v_bits(pv);  // 16: bf16 V; 8, 4: MX codes and block scales
  std::vector<int> Bs = {1, 16, 64}, ctxs = {8192, 32768, 131072};
  if (argc > 2) Bs = {std::atoi(argv[2])};
  if (argc > 3) ctxs = {std::atoi(argv[3])};
  const int splits = argc > 4 ? std::atoi(argv[4]) : 0;
  // DMATTN_BENCH_COLD=1: every step starts with L2 evicted, as in a model, where the other layers' weights
  // pass through L2 between two steps of one layer (B=1's pages, 9-36 MB at 8-32k, otherwise stay in the
  // 50 MB L2 between the repeated steps). Each step is then timed alone.
  const char* cold_env = std::getenv("DMATTN_BENCH_COLD");
  const bool cold = cold_env && cold_env[0] == '1';
  constexpr size_t kFlushBytes = size_t(256) << 20;
  void* flush = nullptr;
  if (cold) CK(cudaMalloc(&flush, kFlushBytes));
  int maxB = 0, maxctx = 0;
  for (int b : Bs) maxB = std::max(maxB, b);
  for (int c : ctxs) maxctx = std::max(maxctx, c);
  const int64_t pages = int64_t(maxB) * (maxctx / T);
  const size_t page_bytes = size_t(Hkv) * (T / 32) * dmattn::cuda::record_bytes(d, vbits);
  uint8_t *rec, *slot;
  CK(cudaMalloc(&rec, pages * page_bytes));
  CK(cudaMalloc(&slot, pages));
  fill<<<4096, 256>>>(rec, pages * page_bytes, d, vbits);
  CK(cudaDeviceSynchronize());

  // Ceiling: device-to-device copy of 2 GiB, read + write bytes.
  {
    const size_t n = size_t(1) << 31;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
    cudaEventRecord(e0);
    for (int i = 0; i < 10; ++i) cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    std::printf("copy %.1f GB/s\n", 2.0 * n * 10 / (ms * 1e6));
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    read_all<<<sms * 8, 512>>>(static_cast<const uint4*>(a), n / 16, static_cast<uint32_t*>(b));
    cudaEventRecord(e0);
    for (int i = 0; i < 10; ++i) read_all<<<sms * 8, 512>>>(static_cast<const uint4*>(a), n / 16, static_cast<uint32_t*>(b));
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(&ms, e0, e1);
    std::printf("read %.1f GB/s\n", double(n) * 10 / (ms * 1e6));
    cudaFree(a);
    cudaFree(b);
  }

  Policy pol = Policy::plain();  // mxfp8-e4m3 on the newest page (the diagonal tile), mxfp4 elsewhere
  pol.pv = pv;
  for (int B : Bs)
    for (int ctx : ctxs) {
      const int np = ctx / T;
      std::vector<int32_t> table(size_t(B) * np), length(size_t(B), ctx);
      std::vector<uint8_t> slots(size_t(pages), 1);
      double bytes = 0;
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < np; ++j) {
          const int32_t pid = b * np + j;
          table[size_t(pid)] = pid;
          const bool high = j == np - 1;  // the newest page: the diagonal tile
          slots[size_t(pid)] = high ? 0 : 1;
          // What the kernel copies: each record from its K codes on (E4M3 on the high page, E2M1 elsewhere).
          bytes += double(Hkv) * (T / dmattn::cuda::kRecordKeys) *
                   (dmattn::cuda::record_bytes(d, vbits) - dmattn::cuda::record_k(d, !high));
        }
      bytes += 2.0 * B * Hq * d * 2;  // q in, out
      int32_t *dtable, *dlen;
      CK(cudaMalloc(&dtable, table.size() * 4));
      CK(cudaMalloc(&dlen, length.size() * 4));
      CK(cudaMemcpy(dtable, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dlen, length.data(), length.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(slot, slots.data(), slots.size(), cudaMemcpyHostToDevice));
      const PagedKV kv{rec, slot, dtable, dlen, B, np, Hkv, d, vbits};
      void *q, *out;
      int* bad;
      CK(cudaMalloc(&q, size_t(B) * Hq * d * 2));
      CK(cudaMalloc(&out, size_t(B) * Hq * d * 2));
      CK(cudaMalloc(&bad, 4));
      CK(cudaMemset(bad, 0, 4));
      fill_bf16<<<64, 256>>>(static_cast<uint16_t*>(q), size_t(B) * Hq * d);
      const TensorView tq = TensorView::contiguous(q, DType::bf16, {B, Hq, 1, d}, Device::cuda);
      const TensorView to = TensorView::contiguous(out, DType::bf16, {B, Hq, 1, d}, Device::cuda);
      const float scale = 0.08838835f;
      decode_paged_async(kv, pol, tq, to, nullptr, scale, splits, bad, nullptr);  // warm-up
      CK(cudaDeviceSynchronize());
      const int iters = ctx * B >= 16 * 131072 ? 10 : 50;
      double us = 0;
      if (cold) {  // each step timed alone, after a 256 MiB write has evicted L2 (the 50 MB of an H200)
        std::vector<cudaEvent_t> ev(size_t(2 * iters));
        for (auto& e : ev) cudaEventCreate(&e);
        for (int i = 0; i < iters; ++i) {
          CK(cudaMemsetAsync(flush, i & 0xFF, kFlushBytes));
          cudaEventRecord(ev[size_t(2 * i)]);
          decode_paged_async(kv, pol, tq, to, nullptr, scale, splits, bad, nullptr);
          cudaEventRecord(ev[size_t(2 * i + 1)]);
        }
        CK(cudaEventSynchronize(ev.back()));
        for (int i = 0; i < iters; ++i) {
          float ms = 0;
          cudaEventElapsedTime(&ms, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]);
          us += 1e3 * ms / iters;
        }
        for (auto& e : ev) cudaEventDestroy(e);
      } else {
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        cudaEventRecord(e0);
        const auto h0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) decode_paged_async(kv, pol, tq, to, nullptr, scale, splits, bad, nullptr);
        // The host's time to enqueue a step: where it nears the device's, the figure is bound by the host.
        std::fprintf(stderr, "host-us %s %d %d %.2f\n", pv_arg.c_str(), B, ctx,
                     std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count() / iters);
        cudaEventRecord(e1);
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        us = 1e3 * ms / iters;
      }
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) decode_paged(kv, pol, tq, to, nullptr, scale, splits, nullptr);
      const double us_sync =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
      int bad_host = 0;
      CK(cudaMemcpy(&bad_host, bad, 4, cudaMemcpyDeviceToHost));
      if (bad_host) std::printf("warning: q flagged non-finite\n");
      std::printf("dmattn-%s %d %d %.2f %.2f %.1f %.0f\n", pv_arg.c_str(), B, ctx, us, us_sync, bytes / (us * 1e3), bytes);
      std::fflush(stdout);
      cudaFree(dtable);
      cudaFree(dlen);
      cudaFree(q);
      cudaFree(out);
      cudaFree(bad);
    }
  return 0;
}
