// PagedKVCache (the KV cache in GPU memory) against KVCache (host memory), the reference for its
// pages: the same appends (prompts of every length, batched one-token steps, chunks that cross
// pages, pages leaving the diagonal window, freed and reused sequences) must leave every logical
// page's records byte for byte as the host cache's device mirror packs them, and decode over the two
// must return identical outputs. Policies cover every page format pair, the pv modes, both scale
// rules, sink tiles and wider bands, and the accuracy transforms; inputs f32 and bf16.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.hpp"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/decode/decode.cuh"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/paged_kv_cache.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

// A device copy of a host tensor, freed on scope exit.
struct OnDevice {
  void* ptr = nullptr;
  TensorView view;
  explicit OnDevice(const HostTensor& t) {
    EXPECT_EQ(cudaMalloc(&ptr, t.nbytes()), cudaSuccess);
    cudaMemcpy(ptr, t.bytes(), t.nbytes(), cudaMemcpyHostToDevice);
    view = TensorView::contiguous(ptr, t.dtype(), t.shape(), Device::cuda);
  }
  ~OnDevice() { cudaFree(ptr); }
};

// The tokens [from, from + n) of one sequence's [1, Hkv, L, d] keys (or values), contiguous.
HostTensor tokens(const HostTensor& x, int64_t from, int64_t n, DType dtype) {
  return HostTensor::copy_of(slice_tokens(x.view(), from, n), dtype);
}

// Token t[i] of each sequence's x[i], as one [S, Hkv, 1, d] batch.
HostTensor one_each(const std::vector<const HostTensor*>& x, const std::vector<int64_t>& t, DType dtype) {
  const Shape s = x[0]->shape();
  const int64_t S = int64_t(x.size()), Hkv = s[1], d = s[3];
  std::vector<float> rows(size_t(S * Hkv * d));
  for (int64_t i = 0; i < S; ++i) {
    const std::vector<float> all = x[size_t(i)]->to_floats();
    const int64_t L = x[size_t(i)]->shape()[2];
    for (int64_t h = 0; h < Hkv; ++h)
      std::memcpy(rows.data() + (i * Hkv + h) * d, all.data() + (h * L + t[size_t(i)]) * d, size_t(d) * sizeof(float));
  }
  return HostTensor::from_floats(rows, {S, Hkv, 1, d}, dtype);
}

// Every logical page of every sequence: the device cache's records against the host page packed.
void expect_same_pages(const KVCache& host, const PagedKVCache& dev, const std::vector<int>& hs,
                       const std::vector<int>& ds, const std::string& what) {
  const int vbits = cuda::v_bits(host.policy().pv);
  for (size_t i = 0; i < hs.size(); ++i) {
    ASSERT_EQ(host.length(hs[i]), dev.length(ds[i])) << what;
    ASSERT_EQ(host.page_table(hs[i]).size(), dev.page_table(ds[i]).size()) << what;
    for (size_t j = 0; j < host.page_table(hs[i]).size(); ++j) {
      std::vector<uint8_t> want(size_t(dev.page_bytes()));
      cuda::pack_page(host.page(host.page_table(hs[i])[j]), host.kv_heads(), int(host.head_dim()), vbits, want.data());
      const std::vector<uint8_t> got = dev.page_records(dev.page_table(ds[i])[j]);
      size_t at = 0;
      while (at < want.size() && want[at] == got[at]) ++at;
      EXPECT_EQ(at, want.size()) << what << ": sequence " << i << " page " << j << " differs first at byte " << at
                                 << " (of " << want.size() << ")";
    }
  }
}

// Decode over both caches, GPU q: identical outputs and LSE.
void expect_same_decode(const KVCache& host, const PagedKVCache& dev, const std::vector<int>& hs,
                        const std::vector<int>& ds, int64_t Hq, int64_t Nq, int splits, const std::string& what) {
  const QKV x = random_qkv({int64_t(hs.size()), Hq, host.kv_heads(), Nq, Nq, host.head_dim()}, uint64_t(Nq + 31 * splits),
                           DType::f32, 2.0f);
  OnDevice q(x.q), a(x.q), b(x.q);
  const size_t rows = size_t(hs.size()) * size_t(Hq * Nq);
  float *la, *lb;
  cudaMalloc(&la, rows * 4);
  cudaMalloc(&lb, rows * 4);
  cudaMemset(a.ptr, 0xFF, x.q.nbytes());  // poisoned: NaN
  cudaMemset(b.ptr, 0xFF, x.q.nbytes());
  DecodeOptions o;
  o.splits = splits;
  decode_attention(host, hs, q.view, a.view, la, o);
  decode_attention(dev, ds, q.view, b.view, lb, o);
  std::vector<float> oa(size_t(x.q.numel())), ob(oa.size()), sa(rows), sb(rows);
  cudaMemcpy(oa.data(), a.ptr, x.q.nbytes(), cudaMemcpyDeviceToHost);
  cudaMemcpy(ob.data(), b.ptr, x.q.nbytes(), cudaMemcpyDeviceToHost);
  cudaMemcpy(sa.data(), la, rows * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(sb.data(), lb, rows * 4, cudaMemcpyDeviceToHost);
  cudaFree(la);
  cudaFree(lb);
  for (size_t i = 0; i < oa.size(); ++i)
    if (std::isnan(oa[i]) || std::isnan(ob[i])) {
      ADD_FAILURE() << what << ": NaN at " << i << " (the poison survived)";
      break;
    }
  EXPECT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * 4), 0) << what << ": decode outputs differ";
  EXPECT_EQ(std::memcmp(sa.data(), sb.data(), rows * 4), 0) << what << ": decode LSE differs";
}

Policy pv_of(Policy p, PV pv) {
  p.pv = pv;
  return p;
}

// The accuracy transforms: the rotation, smooth_k's mean (fixed by each sequence's first append),
// exact sink keys (their rows kept in the state; 160 spans two pages), smooth_q (keys rounded to bf16).
Policy transformed(Policy p, bool rotate, bool smooth_k, int sink_keys, bool smooth_q) {
  p.rotate = rotate;
  p.smooth_k = smooth_k;
  p.sink_keys = sink_keys;
  p.smooth_q = smooth_q ? SmoothQ::all : SmoothQ::off;
  return p;
}

}  // namespace

TEST(GpuPagedCache, PagesAndDecodeMatchHostCache) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const Format e4 = Format::mxfp8_e4m3, e5 = Format::mxfp8_e5m2, f4 = Format::mxfp4;
  Policy ceil_wide = Policy::tiles(e4, f4, 3, 1);
  const std::vector<Policy> policies = {
      Policy{}, Policy::tiles(e4, f4, 2, 1), pv_of(Policy{}, PV::mxfp8), pv_of(ceil_wide, PV::mxfp4),
      Policy::tiles(e5, Format::mxfp6_e3m2, 1, 0), Policy::tiles(f4, e4, 1, 0), Policy::tiles(e4, e4, 1, 0), pv_of(Policy::tiles(f4, f4, 1, 1), PV::mxfp4),
      transformed(Policy{}, true, false, 0, false), transformed(ceil_wide, true, true, 4, false),
      transformed(pv_of(Policy::tiles(e4, f4, 1, 1), PV::mxfp8), false, true, 160, false),
      transformed(pv_of(Policy{}, PV::mxfp4), false, false, 0, true)};
  for (int64_t d : {64, 128, 256})
    for (size_t pi = 0; pi < policies.size(); ++pi) {
      const Policy& pol = policies[pi];
      const DType dt = pi % 2 ? DType::bf16 : DType::f32;
      const std::string what = "d=" + std::to_string(d) + " " + pol.describe() + (dt == DType::bf16 ? " bf16" : " f32");
      const int64_t Hkv = 2, total[3] = {700, 300, 1301};
      std::vector<HostTensor> k, v;
      for (int i = 0; i < 3; ++i) {
        QKV x = llm_like_qkv({1, 4, Hkv, total[i], total[i], d}, uint64_t(100 * d + i + 7 * pi));
        k.push_back(std::move(x.k));
        v.push_back(std::move(x.v));
      }
      KVCache host(Hkv, d, pol);
      PagedKVCache dev(Hkv, d, pol);
      std::vector<int> hs, ds;
      auto append_one = [&](int i, int64_t from, int64_t n) {
        const HostTensor kt = tokens(k[size_t(i)], from, n, dt), vt = tokens(v[size_t(i)], from, n, dt);
        host.append(hs[size_t(i)], kt.view(), vt.view());
        OnDevice dk(kt), dv(vt);
        dev.append({ds[size_t(i)]}, dk.view, dv.view);
      };
      // Prompts: 1, 300 (ends mid-page, mid-block), 600 then 100 (a chunk that crosses pages and
      // sends pages out of the window).
      for (int i = 0; i < 3; ++i) {
        hs.push_back(host.new_sequence());
        ds.push_back(dev.new_sequence());
      }
      append_one(0, 0, 600);
      append_one(0, 600, 1);
      append_one(1, 0, 1);
      append_one(2, 0, 300);
      // One-token steps for all three at once, crossing page and block boundaries.
      std::vector<int64_t> at = {601, 1, 300};
      for (int step = 0; step < 99; ++step) {
        const std::vector<const HostTensor*> ks = {&k[0], &k[1], &k[2]}, vs = {&v[0], &v[1], &v[2]};
        const HostTensor kb = one_each(ks, at, dt), vb = one_each(vs, at, dt);
        for (int i = 0; i < 3; ++i) {
          const HostTensor k1 = tokens(k[size_t(i)], at[size_t(i)], 1, dt), v1 = tokens(v[size_t(i)], at[size_t(i)], 1, dt);
          host.append(hs[size_t(i)], k1.view(), v1.view());
          ++at[size_t(i)];
        }
        OnDevice dk(kb), dv(vb);
        dev.append(ds, dk.view, dv.view);
      }
      expect_same_pages(host, dev, hs, ds, what + " after steps");
      expect_same_decode(host, dev, hs, ds, 8, 1, 1, what + " Nq=1");
      expect_same_decode(host, dev, hs, ds, 8, 5, 3, what + " Nq=5 splits=3");
      // Sequences out of order: the decode gathers their tables (in order it reads the cache's own).
      expect_same_decode(host, dev, {hs[2], hs[0]}, {ds[2], ds[0]}, 8, 1, 2, what + " sequences 2, 0");
      // A freed sequence's pages go to a new one, which must not see their old contents.
      host.free_sequence(hs[1]);
      dev.free_sequence(ds[1]);
      hs[1] = host.new_sequence();
      ds[1] = dev.new_sequence();
      append_one(1, 0, 200);
      append_one(2, at[2], total[2] - at[2]);
      expect_same_pages(host, dev, hs, ds, what + " after reuse");
      expect_same_decode(host, dev, hs, ds, 4, 16, 2, what + " Nq=16 Hq=4");
    }
}

// A large batched prompt: enough rows (S x Hkv x n) that a warp appends a run of several rows
// (kv::rows_per_warp), its runs crossing pages mid-run, the sequences starting at different positions
// (one of them empty, so the append fixes its key mean), and pages the append fills left unzeroed
// first, including pages a freed sequence held.
TEST(GpuPagedCache, LargeBatchedPromptMatchesHostCache) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t S = 4, Hkv = 8, d = 128, n = 8192, before[S] = {300, 0, 77, 1000};
  for (const Policy& pol : {Policy{}, pv_of(Policy{}, PV::mxfp4)}) {
    const std::string what = pol.describe();
    std::vector<HostTensor> k, v;
    for (int64_t i = 0; i < S; ++i) {
      QKV x = llm_like_qkv({1, 4, Hkv, before[i] + n, before[i] + n, d}, uint64_t(31 + i));
      k.push_back(std::move(x.k));
      v.push_back(std::move(x.v));
    }
    KVCache host(Hkv, d, pol);
    PagedKVCache dev(Hkv, d, pol);
    {  // pages that held another sequence, freed: the new ones must not see their bytes
      const int junk = dev.new_sequence();
      const HostTensor kt = tokens(k[0], 0, 1024, DType::bf16), vt = tokens(v[0], 0, 1024, DType::bf16);
      OnDevice dk(kt), dv(vt);
      dev.append({junk}, dk.view, dv.view);
      dev.free_sequence(junk);
    }
    std::vector<int> hs, ds;
    for (int64_t i = 0; i < S; ++i) {
      hs.push_back(host.new_sequence());
      ds.push_back(dev.new_sequence());
      if (before[i] == 0) continue;
      const HostTensor kt = tokens(k[size_t(i)], 0, before[i], DType::bf16), vt = tokens(v[size_t(i)], 0, before[i], DType::bf16);
      host.append(hs.back(), kt.view(), vt.view());
      OnDevice dk(kt), dv(vt);
      dev.append({ds.back()}, dk.view, dv.view);
    }
    // The batch: n tokens of every sequence, [S, Hkv, n, d].
    std::vector<float> kb, vb;
    for (int64_t i = 0; i < S; ++i) {
      const HostTensor kt = tokens(k[size_t(i)], before[i], n, DType::bf16), vt = tokens(v[size_t(i)], before[i], n, DType::bf16);
      host.append(hs[size_t(i)], kt.view(), vt.view());
      const std::vector<float> kf = kt.to_floats(), vf = vt.to_floats();
      kb.insert(kb.end(), kf.begin(), kf.end());
      vb.insert(vb.end(), vf.begin(), vf.end());
    }
    const HostTensor kt = HostTensor::from_floats(kb, {S, Hkv, n, d}, DType::bf16), vt = HostTensor::from_floats(vb, {S, Hkv, n, d}, DType::bf16);
    OnDevice dk(kt), dv(vt);
    dev.append(ds, dk.view, dv.view);
    expect_same_pages(host, dev, hs, ds, what + " large batched prompt");
    expect_same_decode(host, dev, hs, ds, 32, 1, 4, what + " large batched prompt, Nq=1");
  }
}

TEST(GpuPagedCache, RejectsWhatItCannotHold) {
  SKIP_WITHOUT_CUDA_DEVICE();
  EXPECT_THROW(PagedKVCache(2, 96, Policy{}), Error);
  EXPECT_THROW(PagedKVCache(2, 64, Policy::tiles(Format::mxfp8_e4m3, Format::nvfp4, 1, 0)), Error);
  PagedKVCache c(2, 64, Policy{});
  const int s = c.new_sequence();
  const QKV x = random_qkv({1, 2, 2, 4, 4, 64}, 1);
  EXPECT_THROW(c.append({s}, x.k.view(), x.v.view()), Error);  // host tensors
  OnDevice k(x.k), v(x.v);
  EXPECT_THROW(c.append({s, s}, k.view, v.view), Error);  // shape / twice
  EXPECT_THROW(c.append({s + 1}, k.view, v.view), Error);  // no such sequence
  OnDevice q(random_qkv({1, 4, 2, 8, 8, 64}, 2).q), o(random_qkv({1, 4, 2, 8, 8, 64}, 2).q);
  c.append({s}, k.view, v.view);                                    // 4 tokens
  EXPECT_THROW(decode_attention(c, {s}, q.view, o.view, nullptr), Error);  // 8 queries, 4 tokens
}

// CUDA graphs: an append + decode step captured once and replayed with prepare() before each replay
// equals the same steps run eagerly on a second cache, bit for bit (outputs, LSE, every page), across
// page openings and pages leaving the window; a replay without prepare() appends nothing and returns
// NaN; what a captured cache cannot do throws.
TEST(GpuPagedCache, GraphReplaysEqualEagerSteps) {
  SKIP_WITHOUT_CUDA_DEVICE();
  setenv("DMATTN_DECODE_CTAS", "2", 1);  // one decode instance for both caches (the graph's reads every table column)
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  const std::vector<Policy> policies = {Policy{}, pv_of(Policy::tiles(e4, f4, 3, 1), PV::mxfp4),
                                        transformed(pv_of(Policy::tiles(e4, f4, 2, 1), PV::mxfp8), true, true, 4, false)};
  const int64_t d = 128, Hkv = 2, Hq = 8, steps = 200, prompt[3] = {600, 1, 300};
  for (const Policy& pol : policies) {
    const std::string what = pol.describe();
    std::vector<HostTensor> k, v;
    for (int i = 0; i < 3; ++i) {
      QKV x = llm_like_qkv({1, 4, Hkv, prompt[i] + steps + 1, prompt[i] + steps + 1, d}, uint64_t(40 + i));
      k.push_back(std::move(x.k));
      v.push_back(std::move(x.v));
    }
    PagedKVCache eager(Hkv, d, pol), graph(Hkv, d, pol);
    std::vector<int> es, gs;
    for (int i = 0; i < 3; ++i) {
      es.push_back(eager.new_sequence());
      gs.push_back(graph.new_sequence());
      const HostTensor kt = tokens(k[size_t(i)], 0, prompt[i], DType::f32), vt = tokens(v[size_t(i)], 0, prompt[i], DType::f32);
      OnDevice dk(kt), dv(vt);
      eager.append({es.back()}, dk.view, dv.view);
      graph.append({gs.back()}, dk.view, dv.view);
    }
    graph.reserve(3, prompt[0] + steps + 1);
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // The graph's inputs and outputs: fixed buffers, refilled before each replay.
    std::vector<int64_t> at = {prompt[0], prompt[1], prompt[2]};
    const std::vector<const HostTensor*> ks = {&k[0], &k[1], &k[2]}, vs = {&v[0], &v[1], &v[2]};
    OnDevice k1(one_each(ks, at, DType::f32)), v1(one_each(vs, at, DType::f32));
    const QKV qx = random_qkv({3, Hq, Hkv, 1, 1, d}, 9, DType::f32, 2.0f);
    OnDevice q(qx.q), out_g(qx.q), out_e(qx.q);
    float *lse_g, *lse_e;
    CUDA_OK(cudaMalloc(&lse_g, 3 * Hq * 4));
    CUDA_OK(cudaMalloc(&lse_e, 3 * Hq * 4));
    DecodeOptions o;
    o.splits = 2;
    o.stream = st;
    decode_attention(graph, gs, q.view, out_g.view, lse_g, o);  // warm-up: lazy set-up happens outside the capture
    CUDA_OK(cudaStreamSynchronize(st));
    cudaGraph_t g;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    graph.append(gs, k1.view, v1.view, st);
    decode_attention(graph, gs, q.view, out_g.view, lse_g, o);
    CUDA_OK(cudaStreamEndCapture(st, &g));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
    const size_t on = size_t(qx.q.numel());
    std::vector<float> a(on), b(on), la(3 * Hq), lb(3 * Hq);
    auto compare = [&](int64_t step) {
      CUDA_OK(cudaStreamSynchronize(st));
      cudaMemcpy(a.data(), out_e.ptr, on * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(b.data(), out_g.ptr, on * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(la.data(), lse_e, la.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(lb.data(), lse_g, lb.size() * 4, cudaMemcpyDeviceToHost);
      ASSERT_FALSE(std::isnan(a[0])) << what << " step " << step;
      ASSERT_EQ(std::memcmp(a.data(), b.data(), on * 4), 0) << what << ": outputs differ at step " << step;
      ASSERT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 4), 0) << what << ": LSE differs at step " << step;
    };
    for (int64_t step = 0; step < steps; ++step) {
      const HostTensor kb = one_each(ks, at, DType::f32), vb = one_each(vs, at, DType::f32);
      CUDA_OK(cudaMemcpyAsync(k1.ptr, kb.bytes(), kb.nbytes(), cudaMemcpyHostToDevice, st));
      CUDA_OK(cudaMemcpyAsync(v1.ptr, vb.bytes(), vb.nbytes(), cudaMemcpyHostToDevice, st));
      cudaMemsetAsync(out_g.ptr, 0xFF, on * 4, st);  // poisoned: NaN
      graph.prepare(gs, 1, st);
      CUDA_OK(cudaGraphLaunch(exec, st));
      CUDA_OK(cudaStreamSynchronize(st));
      eager.append(es, k1.view, v1.view);
      decode_attention(eager, es, q.view, out_e.view, lse_e, DecodeOptions{std::nullopt, 2});
      compare(step);
      for (int64_t& t : at) ++t;
    }
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(graph.length(gs[size_t(i)]), eager.length(es[size_t(i)])) << what;
      for (size_t j = 0; j < eager.page_table(es[size_t(i)]).size(); ++j)
        EXPECT_EQ(graph.page_records(graph.page_table(gs[size_t(i)])[j]), eager.page_records(eager.page_table(es[size_t(i)])[j]))
            << what << ": sequence " << i << " page " << j;
    }
    // A replay without prepare(): nothing appended, NaN out (and the pages as they were).
    CUDA_OK(cudaGraphLaunch(exec, st));
    CUDA_OK(cudaStreamSynchronize(st));
    cudaMemcpy(b.data(), out_g.ptr, on * 4, cudaMemcpyDeviceToHost);
    for (float x : b) ASSERT_TRUE(std::isnan(x)) << what << ": a stale replay must return NaN";
    // The next prepared replay carries on.
    {
      const HostTensor kb = one_each(ks, at, DType::f32), vb = one_each(vs, at, DType::f32);
      CUDA_OK(cudaMemcpy(k1.ptr, kb.bytes(), kb.nbytes(), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(v1.ptr, vb.bytes(), vb.nbytes(), cudaMemcpyHostToDevice));
      graph.prepare(gs, 1, st);
      CUDA_OK(cudaGraphLaunch(exec, st));
      eager.append(es, k1.view, v1.view);
      decode_attention(eager, es, q.view, out_e.view, lse_e, DecodeOptions{std::nullopt, 2});
      compare(steps);
    }
    // The graph captured sequences that held tokens, so its replays leave smooth_k's key-mean pass out:
    // a first append cannot take them (an eager one can).
    if (pol.smooth_k) {
      const int fresh = graph.new_sequence();
      EXPECT_THROW(graph.prepare({fresh}, 1, st), Error) << what;
      graph.free_sequence(fresh);
    }
    // The captured cache's memory stays where the graph holds it: sequences past its reserve throw.
    const HostTensor big = tokens(k[0], 0, prompt[0], DType::f32);
    OnDevice dbig(big);
    EXPECT_THROW(
        [&] {
          for (int r = 0; r < 64; ++r) graph.append({graph.new_sequence()}, dbig.view, dbig.view);
        }(),
        Error);
    // A prepared sequence takes no eager append (it would race the replays' plans).
    EXPECT_THROW(graph.append(gs, k1.view, v1.view), Error);
    // Under capture, an append needs the room reserve() makes for its plans.
    PagedKVCache other(Hkv, d, pol);
    const std::vector<int> os = {other.new_sequence(), other.new_sequence(), other.new_sequence()};
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    EXPECT_THROW(other.append(os, k1.view, v1.view, st), Error);
    cudaGraph_t bad = nullptr;
    cudaStreamEndCapture(st, &bad);
    if (bad) cudaGraphDestroy(bad);
    cudaGetLastError();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    cudaFree(lse_g);
    cudaFree(lse_e);
    cudaStreamDestroy(st);
  }
  unsetenv("DMATTN_DECODE_CTAS");
}
