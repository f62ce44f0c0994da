// decode_attention with CUDA tensors (the GQA-packed split-KV kernel over the cache's device mirror)
// against the CPU decode (the oracle) on the same cache: rel. L2 <= 1e-5 and LSE, for ragged
// batches, GQA and MQA (row chunks), Nq 1..16, several policies (pv = bf16 and mxfp8), fixed and
// automatic splits, a cache
// that grows and re-encodes pages between calls (incremental mirror), freed and reused pages;
// outputs poisoned before every call.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.hpp"

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <limits>

#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

struct DeviceCopy {  // a device copy of a host tensor (or poison of its size), freed on scope exit
  void* ptr = nullptr;
  TensorView view;
  DeviceCopy(const HostTensor& t, bool poison) {
    if (cudaMalloc(&ptr, t.nbytes()) != cudaSuccess) throw Error("cudaMalloc");
    if (poison)
      cudaMemset(ptr, 0xFF, t.nbytes());  // NaN in every float dtype
    else
      cudaMemcpy(ptr, t.bytes(), t.nbytes(), cudaMemcpyHostToDevice);
    view = TensorView::contiguous(ptr, t.dtype(), t.shape(), Device::cuda);
  }
  ~DeviceCopy() { cudaFree(ptr); }
};

// The GPU decode of q over the cache vs the CPU decode with the same options; returns rel. L2.
double check_decode(const KVCache& cache, const std::vector<int>& ids, const HostTensor& q, int splits, double tol,
                    const char* what, int64_t window_left = -1) {
  DecodeOptions o;
  o.splits = splits;
  o.window_left = window_left;
  HostTensor want(q.dtype(), q.shape());
  const size_t rows = size_t(q.shape()[0] * q.shape()[1] * q.shape()[2]);
  std::vector<float> want_lse(rows), got_lse(rows);
  decode_attention(cache, ids, q.view(), want.view(), want_lse.data(), o);
  DeviceCopy dq(q, false), dout(want, true);
  float* dlse;
  EXPECT_EQ(cudaMalloc(&dlse, rows * 4), cudaSuccess);
  cudaMemset(dlse, 0xFF, rows * 4);
  decode_attention(cache, ids, dq.view, dout.view, dlse, o);
  HostTensor got(q.dtype(), q.shape());
  cudaMemcpy(got.bytes(), dout.ptr, got.nbytes(), cudaMemcpyDeviceToHost);
  cudaMemcpy(got_lse.data(), dlse, rows * 4, cudaMemcpyDeviceToHost);
  cudaFree(dlse);
  const Comparison c = compare(got.to_floats(), want.to_floats());
  std::printf("decode %s %s splits=%d: rel_l2 %.3e\n", what, cache.policy().describe().c_str(), splits, c.rel_l2);
  EXPECT_EQ(c.nan_count, 0) << what;
  EXPECT_LE(c.rel_l2, tol) << what;
  if (c.rel_l2 > tol) {  // the row that deviates most, to tell a mask error (whole rows) from rounding (one element)
    const std::vector<float> g = got.to_floats(), w = want.to_floats();
    const size_t d = size_t(q.shape()[3]);
    size_t worst = 0;
    double worst_err = -1;
    for (size_t i = 0; i < rows; ++i) {
      double e = 0, n = 0;
      for (size_t c2 = 0; c2 < d; ++c2) e += std::pow(g[i * d + c2] - w[i * d + c2], 2), n += std::pow(w[i * d + c2], 2);
      if (e / (n + 1e-30) > worst_err) worst_err = e / (n + 1e-30), worst = i;
    }
    size_t col = 0;
    for (size_t c2 = 0; c2 < d; ++c2)
      if (std::fabs(g[worst * d + c2] - w[worst * d + c2]) > std::fabs(g[worst * d + col] - w[worst * d + col])) col = c2;
    ADD_FAILURE() << what << ": worst row " << worst << " rel " << std::sqrt(worst_err) << ", column " << col << " got "
                  << g[worst * d + col] << " want " << w[worst * d + col] << ", lse got " << got_lse[worst] << " want "
                  << want_lse[worst];
  }
  for (size_t i = 0; i < rows; ++i)
    EXPECT_NEAR(got_lse[i], want_lse[i], (splits == 0 ? 1e-3f : 1e-5f) * (1 + std::fabs(want_lse[i]))) << what << " row " << i;  // l sums unrounded P
  // Without the LSE a rotating policy's queries are rotated in the kernel's prologue instead of a
  // pre-pass (smooth_k's shift has nothing to move): the same rows, bit for bit.
  DeviceCopy dout2(want, true);
  decode_attention(cache, ids, dq.view, dout2.view, nullptr, o);
  HostTensor got2(q.dtype(), q.shape());
  cudaMemcpy(got2.bytes(), dout2.ptr, got2.nbytes(), cudaMemcpyDeviceToHost);
  EXPECT_EQ(got2.to_floats(), got.to_floats()) << what << ": the decode without the LSE";
  return c.rel_l2;
}

Policy with_pv(Policy p, PV pv = PV::mxfp8) {  // V in MX 32-key blocks, P quantized to MXFP8 for P.V
  p.pv = pv;
  return p;
}

void append_all(KVCache& cache, int id, const QKV& x, int64_t from, int64_t n) {
  cache.append(id, slice_tokens(x.k.view(), from, n), slice_tokens(x.v.view(), from, n));
}

// Three sequences of LLM-like keys and values of lengths lens (seeds seed, seed + 1, seed + 2) for Hq
// query heads, each appended whole, or with its last `last` tokens as a second append.
std::vector<int> fill_three(KVCache& cache, int64_t Hq, const int64_t (&lens)[3], uint64_t seed, int64_t last = 0) {
  std::vector<int> ids;
  for (int i = 0; i < 3; ++i) {
    const QKV x = llm_like_qkv({1, Hq, cache.kv_heads(), lens[i], lens[i], cache.head_dim()}, seed + uint64_t(i));
    ids.push_back(cache.new_sequence());
    append_all(cache, ids.back(), x, 0, lens[i] - last);
    if (last > 0) append_all(cache, ids.back(), x, lens[i] - last, last);
  }
  return ids;
}

}  // namespace

TEST(GpuDecode, MatchesCpuDecode) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  for (int64_t d : {64, 128, 256})
    for (const Policy& pol : {Policy::plain(), Policy::tiles(e4, f4, 2, 1), Policy::tiles(Format::mxfp8_e5m2, Format::mxfp6_e3m2, 1, 0),
                              Policy::tiles(Format::mxfp6_e2m3, Format::mxfp6_e2m3, 1, 0), with_pv(Policy::plain()),
                              with_pv(Policy::tiles(e4, f4, 2, 1)), with_pv(Policy::plain(), PV::mxfp4)}) {
      const int64_t Hkv = 2, Hq = 8, lens[3] = {16, 700, 1301};
      KVCache cache(Hkv, d, pol);
      std::vector<int> ids;
      std::vector<QKV> xs;
      for (int i = 0; i < 3; ++i) {
        xs.push_back(llm_like_qkv({1, Hq, Hkv, lens[i] + 200, lens[i] + 200, d}, uint64_t(10 * d + i)));
        ids.push_back(cache.new_sequence());
        append_all(cache, ids.back(), xs.back(), 0, lens[i] / 2);
        append_all(cache, ids.back(), xs.back(), lens[i] / 2, lens[i] - lens[i] / 2);
      }
      const double tol = 1e-5;  // pv = mxfp8 included (measured <= 2.5e-7, bench/RESULTS.md)
      for (int64_t Nq : {1, 2, 5, 16}) {  // 4, 8 (one N tile of 8 rows), 20, 64 rows per KV head
        const QKV qs = random_qkv({3, Hq, Hkv, Nq, Nq, d}, uint64_t(d + Nq), DType::f32, 2.0f);
        for (int splits : {1, 3})
          check_decode(cache, ids, qs.q, splits, tol, ("d=" + std::to_string(d) + " Nq=" + std::to_string(Nq)).c_str());
      }
      // The cache grows between calls (pages fill, leave the window and are re-encoded): the device
      // mirror uploads what changed.
      for (int i = 0; i < 3; ++i) append_all(cache, ids[size_t(i)], xs[size_t(i)], lens[i], 200);
      const QKV q2 = random_qkv({3, Hq, Hkv, 4, 4, d}, uint64_t(7 * d), DType::f32, 2.0f);
      check_decode(cache, ids, q2.q, 2, tol, "after appends");
      // Automatic splits (many on the GPU, one on the CPU): P is rounded against each split's own
      // maximum, to bf16 (~3e-4 measured) or, with pv = mxfp8, to E4M3 (4e-3 ... 8e-3 measured).
      check_decode(cache, ids, q2.q, 0, pol.pv != PV::bf16 ? 2e-2 : 1e-3, "automatic splits");
      // bf16 in and out: both sides round fp32 results that agree to ~1e-6 to bf16 (8 bits), so a
      // fraction ~1e-6 / 2^-8 of the outputs land one bf16 step (2^-8) apart: rel. L2 ~
      // sqrt(4e-4) * 4e-3 ~ 1e-4. The fp32 cases above hold the 1e-5 bound.
      const QKV q3 = random_qkv({3, Hq, Hkv, 4, 4, d}, uint64_t(9 * d), DType::bf16, 2.0f);
      check_decode(cache, ids, q3.q, 2, 3e-4, "bf16");
    }
}

// Sliding windows: pages before every row's window are not read (the splits divide the rest), keys
// before a row's window start are masked; ragged lengths, windows narrower than a page, ending
// mid-page and wider than the sequence, GQA and MQA row chunks, Nq 1..16, sink keys.
TEST(GpuDecode, SlidingWindowsMatchCpuDecode) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Policy sinks = Policy::tiles(Format::mxfp8_e4m3, Format::mxfp4, 1, 1);
  sinks.sink_keys = 4;
  for (int64_t d : {64, 128, 256})
    for (const Policy& pol : {Policy::plain(), with_pv(Policy::plain(), PV::mxfp4), sinks}) {
      const int64_t Hkv = 2, Hq = 8, lens[3] = {16, 700, 1301};
      KVCache cache(Hkv, d, pol);
      const std::vector<int> ids = fill_three(cache, Hq, lens, uint64_t(30 * d));
      for (int64_t Nq : {1, 5, 16})
        for (int64_t left : {0, 3, 100, 333, 4096}) {
          const QKV qs = random_qkv({3, Hq, Hkv, Nq, Nq, d}, uint64_t(d + Nq + left), DType::f32, 2.0f);
          const std::string what = "window d=" + std::to_string(d) + " Nq=" + std::to_string(Nq) + " left=" + std::to_string(left);
          // The output's tolerance admits one P rounded to the neighbouring bf16 value (the CPU's exp
          // and the GPU's ex2.approx differ in the last bits), which in the 16-key sequence moves a
          // row by ~3e-4; a key masked wrongly moves that row's LSE, which check_decode holds to 1e-5.
          check_decode(cache, ids, qs.q, 1, 1e-4, what.c_str(), left);
          check_decode(cache, ids, qs.q, 3, 1e-4, what.c_str(), left);
        }
    }
}

// The accuracy transforms (rotate, smooth_k, sink keys) over the cache: the query pre-pass (rotation,
// bf16 rounding, exact sink scores, LSE shift) and the kernel's sink scores against the CPU decode,
// sink keys spanning two pages included, with ragged lengths and GQA.
TEST(GpuDecode, TransformsMatchCpuDecode) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  std::vector<Policy> pols;
  for (int mask = 1; mask < 8; ++mask) {
    Policy p = Policy::tiles(e4, f4, 1, mask >> 2);
    p.rotate = mask & 1;
    p.smooth_k = mask & 2;
    p.sink_keys = mask & 4 ? 4 : 0;
    pols.push_back(p);
  }
  Policy wide = with_pv(pols.back(), PV::mxfp4);
  wide.sink_keys = 160;
  pols.push_back(wide);
  for (int64_t d : {64, 128, 256})
    for (const Policy& pol : pols) {
      const int64_t Hkv = 2, Hq = 8, lens[3] = {3, 300, 1301};
      KVCache cache(Hkv, d, pol);
      const std::vector<int> ids = fill_three(cache, Hq, lens, uint64_t(40 * d), 1);
      for (int64_t Nq : {1, 3}) {
        const QKV qs = llm_like_qkv({3, Hq, Hkv, Nq, Nq, d}, uint64_t(d + Nq + 100));
        check_decode(cache, ids, qs.q, 2, 1e-5, ("transforms d=" + std::to_string(d) + " Nq=" + std::to_string(Nq)).c_str());
      }
    }
}

// The instances of three and four CTAs an SM (8-row CTAs; V in MXFP4 fits four, MXFP8 three: fewer
// stages a warp), which the automatic plan picks only for grids that fill the GPU: forced here, against
// the CPU decode (DMATTN_DECODE_CTAS; a forced count above what the instance fits runs the largest).
TEST(GpuDecode, ManyCtasAnSmInstancesMatchCpuDecode) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const char* ctas : {"3", "4"}) {
    ASSERT_EQ(setenv("DMATTN_DECODE_CTAS", ctas, 1), 0);
    for (PV pv : {PV::mxfp4, PV::mxfp8})
      for (int64_t d : {64, 128, 256}) {
        const int64_t Hkv = 2, Hq = 8, lens[2] = {300, 1301};
        KVCache cache(Hkv, d, with_pv(Policy::plain(), pv));
        std::vector<int> ids;
        for (int i = 0; i < 2; ++i) {
          const QKV x = llm_like_qkv({1, Hq, Hkv, lens[i], lens[i], d}, uint64_t(30 * d + i));
          ids.push_back(cache.new_sequence());
          append_all(cache, ids.back(), x, 0, lens[i]);
        }
        for (int64_t Nq : {1, 2}) {  // 4 and 8 rows per KV head: one 8-row CTA
          const QKV qs = random_qkv({2, Hq, Hkv, Nq, Nq, d}, uint64_t(d + 3 * Nq), DType::f32, 2.0f);
          for (int splits : {1, 3})
            check_decode(cache, ids, qs.q, splits, 1e-5,
                         (std::string(ctas) + " CTAs/SM d=" + std::to_string(d) + " Nq=" + std::to_string(Nq)).c_str());
        }
      }
  }
  unsetenv("DMATTN_DECODE_CTAS");
}

// MQA with 16 new queries: 128 rows per KV head, two row chunks per CTA group. A sequence freed and
// its pages reused by another leaves holes in the page tables. Every V format (the sanitizer's case:
// bench/device.sh), with one KV head (an odd count: the E2M1 V^T upload's head arithmetic).
TEST(GpuDecode, RowChunksAndReusedPages) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t d = 128, Hq = 8, Hkv = 1;
  for (PV pv : {PV::bf16, PV::mxfp8, PV::mxfp4}) {
    KVCache cache(Hkv, d, with_pv(Policy::plain(), pv));
    const QKV a = llm_like_qkv({1, Hq, Hkv, 900, 900, d}, 1), b = llm_like_qkv({1, Hq, Hkv, 600, 600, d}, 2);
    const int ia = cache.new_sequence(), ib = cache.new_sequence();
    append_all(cache, ia, a, 0, 500);
    append_all(cache, ib, b, 0, 300);
    const QKV q0 = random_qkv({2, Hq, Hkv, 16, 16, d}, 3, DType::f32, 2.0f);
    check_decode(cache, {ia, ib}, q0.q, 1, 1e-5, "MQA Nq=16");
    cache.free_sequence(ia);
    const int ic = cache.new_sequence();
    append_all(cache, ic, a, 0, 900);  // reuses ia's pages, then takes new ones
    append_all(cache, ib, b, 300, 300);
    const QKV q1 = random_qkv({2, Hq, Hkv, 16, 16, d}, 4, DType::f32, 2.0f);
    check_decode(cache, {ib, ic}, q1.q, 3, 1e-5, "reused pages");
  }
}

TEST(GpuDecode, Errors) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t d = 64, Hq = 4, Hkv = 2;
  KVCache cache(Hkv, d, Policy::plain());
  const QKV x = llm_like_qkv({1, Hq, Hkv, 300, 300, d}, 5);
  const int id = cache.new_sequence();
  append_all(cache, id, x, 0, 300);
  const QKV qs = random_qkv({1, Hq, Hkv, 2, 2, d}, 6, DType::f32, 1.0f);
  std::vector<float> vals = qs.q.to_floats();
  vals[77] = std::numeric_limits<float>::quiet_NaN();
  const HostTensor bad = HostTensor::from_floats(vals, qs.q.shape(), DType::f32);
  DeviceCopy dq(bad, false), dout(qs.q, true);
  EXPECT_THROW(decode_attention(cache, {id}, dq.view, dout.view, nullptr), Error);  // NaN query
  std::vector<float> host_lse(8);
  DeviceCopy good(qs.q, false);
  EXPECT_THROW(decode_attention(cache, {id}, good.view, dout.view, host_lse.data()), Error);  // host lse
  KVCache wide(Hkv, 96, Policy::plain());  // the CPU handles d = 96, the GPU decode 64, 128 and 256
  const QKV xw = llm_like_qkv({1, Hq, Hkv, 40, 40, 96}, 7);
  const int iw = wide.new_sequence();
  append_all(wide, iw, xw, 0, 40);
  const QKV qw = random_qkv({1, Hq, Hkv, 1, 1, 96}, 8, DType::f32, 1.0f);
  DeviceCopy dqw(qw.q, false), doutw(qw.q, true);
  EXPECT_THROW(decode_attention(wide, {iw}, dqw.view, doutw.view, nullptr), Error);
}

// decode_on_device (host q/out staged to the GPU; what `dmattn decode --backend cuda` calls) against
// the CPU decode on the same cache, the same splits; out poisoned by the CPU-side buffer's content.
TEST(GpuDecode, OnDeviceFromHostTensors) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t d = 128, Hq = 8, Hkv = 2;
  KVCache cache(Hkv, d, with_pv(Policy::plain()));
  const QKV x = llm_like_qkv({1, Hq, Hkv, 700, 700, d}, 11);
  const int id = cache.new_sequence();
  append_all(cache, id, x, 0, 700);
  const QKV qs = random_qkv({1, Hq, Hkv, 3, 3, d}, 12, DType::f32, 2.0f);
  DecodeOptions o;
  o.splits = 2;
  HostTensor want(DType::f32, qs.q.shape()), got(DType::f32, qs.q.shape());
  std::vector<float> want_lse(size_t(Hq * 3)), got_lse(size_t(Hq * 3), std::nanf(""));
  decode_attention(cache, {id}, qs.q.view(), want.view(), want_lse.data(), o);
  std::vector<float> poison(size_t(got.numel()), std::nanf(""));
  got = HostTensor::from_floats(poison, qs.q.shape(), DType::f32);
  for (int rep = 0; rep < 2; ++rep) {  // the first call creates the mirror, the second reuses it
    const double ms = decode_on_device(cache, {id}, qs.q.view(), got.view(), got_lse.data(), o);
    EXPECT_GT(ms, 0.0);
    const Comparison c = compare(got.to_floats(), want.to_floats());
    std::printf("decode_on_device call %d: rel_l2 %.3e, %.3f ms\n", rep, c.rel_l2, ms);
    EXPECT_EQ(c.nan_count, 0);
    EXPECT_LE(c.rel_l2, 1e-5);
    for (size_t i = 0; i < got_lse.size(); ++i) EXPECT_NEAR(got_lse[i], want_lse[i], 1e-5f * (1 + std::fabs(want_lse[i])));
  }
}
