// Properties of the CPU attention paths: policy corners, masks, GQA, lengths, LSE merging,
// determinism, input validation, and the exact path against a naive fp64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/npy.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

struct Result {
  std::vector<float> out, lse;
};

Result run(const QKV& x, AttentionOptions o) {
  HostTensor out(DType::f32, x.q.shape());
  // Poison the output so a row the backend forgets to write is caught.
  std::vector<float> poison(size_t(out.numel()), std::numeric_limits<float>::quiet_NaN());
  std::memcpy(out.bytes(), poison.data(), out.nbytes());
  const Shape& s = x.q.shape();
  Result r;
  r.lse.assign(size_t(s[0] * s[1] * s[2]), std::numeric_limits<float>::quiet_NaN());
  attention(x.q.view(), x.k.view(), x.v.view(), out.view(), r.lse.data(), o);
  r.out = out.to_floats();
  return r;
}

AttentionOptions opts(Policy p, bool causal = false) {
  AttentionOptions o;
  o.policy = p;
  o.causal = causal;
  return o;
}

// Naive fp64 attention written independently of the library.
// window: keys n with p - left <= n <= p + right (negative: unbounded), p the row's position.
std::vector<double> naive(const QKV& x, bool causal, double scale, int64_t left = -1, int64_t right = -1) {
  const Shape qs = x.q.shape(), ks = x.k.shape();
  const std::vector<float> q = x.q.to_floats(), k = x.k.to_floats(), v = x.v.to_floats();
  const int64_t B = qs[0], Hq = qs[1], Nq = qs[2], d = qs[3], Hkv = ks[1], Nk = ks[2];
  std::vector<double> o(q.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      for (int64_t r = 0; r < Nq; ++r) {
        std::vector<double> s;
        const float* qr = &q[size_t(((b * Hq + h) * Nq + r) * d)];
        const int64_t pos = r + Nk - Nq;
        int64_t end = causal ? std::min(Nk, std::max<int64_t>(0, pos + 1)) : Nk;
        if (right >= 0) end = std::min(end, std::max<int64_t>(0, pos + right + 1));
        const int64_t begin = left >= 0 ? std::min(end, std::max<int64_t>(0, pos - left)) : 0;
        double m = -1e300;
        for (int64_t n = begin; n < end; ++n) {
          const float* kr = &k[size_t(((b * Hkv + hk) * Nk + n) * d)];
          double dot = 0;
          for (int64_t i = 0; i < d; ++i) dot += double(qr[i]) * kr[i];
          s.push_back(dot * scale);
          m = std::max(m, s.back());
        }
        double l = 0;
        for (double& e : s) l += (e = std::exp(e - m));
        for (int64_t n = begin; n < end; ++n) {
          const float* vr = &v[size_t(((b * Hkv + hk) * Nk + n) * d)];
          for (int64_t i = 0; i < d; ++i) o[size_t(((b * Hq + h) * Nq + r) * d + i)] += s[size_t(n - begin)] / l * vr[i];
        }
      }
    }
  return o;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) { return compare(a, b).rel_l2; }

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Output errors vs fp64 of all-MXFP8 E4M3, all-MXFP4 and a DMA policy, causal.
struct FormatErrors {
  double e8, e4, dma;
};
FormatErrors format_errors(const QKV& x, const Policy& dma) {
  AttentionOptions ex = opts({}, true);
  ex.exact = true;
  const std::vector<float> ref = run(x, ex).out;
  return {rel_l2(run(x, opts(Policy::all(Format::mxfp8_e4m3), true)).out, ref),
          rel_l2(run(x, opts(Policy::all(Format::mxfp4), true)).out, ref), rel_l2(run(x, opts(dma, true)).out, ref)};
}

}  // namespace

TEST(AttentionCpu, ExactMatchesNaiveFp64) {
  for (bool causal : {false, true}) {
    const QKV x = random_qkv({2, 4, 2, 77, 200, 64}, 1);
    const Result r = run(x, [&] { AttentionOptions o = opts({}, causal); o.exact = true; return o; }());
    const std::vector<double> ref = naive(x, causal, 1.0 / 8.0);
    double e2 = 0, r2 = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      e2 += (r.out[i] - ref[i]) * (r.out[i] - ref[i]);
      r2 += ref[i] * ref[i];
    }
    EXPECT_LE(std::sqrt(e2 / r2), 1e-6);
  }
}

TEST(AttentionCpu, HugeDiagIsAllHighAndZeroIsAllLow) {
  for (bool causal : {false, true}) {
    for (PV pv : {PV::bf16, PV::mxfp8, PV::mxfp4, PV::fp8}) {
      const QKV x = random_qkv({1, 2, 1, 300, 520, 64}, 2);
      Policy dma = Policy::plain();
      dma.pv = pv;
      dma.diag_tiles = 100;
      Policy high = Policy::all(dma.high), low = Policy::all(dma.low);
      high.pv = low.pv = pv;
      EXPECT_TRUE(bit_equal(run(x, opts(dma, causal)).out, run(x, opts(high, causal)).out));
      dma.diag_tiles = 0;
      EXPECT_TRUE(bit_equal(run(x, opts(dma, causal)).out, run(x, opts(low, causal)).out));
      dma.sink_tiles = 100;  // every key tile is a sink tile
      EXPECT_TRUE(bit_equal(run(x, opts(dma, causal)).out, run(x, opts(high, causal)).out));
    }
  }
}

// The CUDA prefill's 32-bit per-tile test equals Policy::is_high on every key tile of a query tile,
// for bands that reach past either end (huge diag_tiles), none (0), negative query tiles (Nq > Nk)
// and sink counts beyond the tiles; with the key tiles starting at absolute tile ktile0 (a block of a
// longer sequence), in absolute tiles.
TEST(Policy, HighTilesEqualsIsHigh) {
  constexpr int kBig = std::numeric_limits<int>::max();
  int checked = 0;
  for (int64_t ktile0 : {0, 1, 3, 40, 1 << 20})
    for (int diag : {0, 1, 2, 3, 7, 100, kBig})
      for (int sinks : {0, 1, 2, 5, 42, kBig})
        for (int64_t qtile = -5; qtile <= 40; ++qtile)
          for (int tiles : {0, 1, 2, 3, 17, 41}) {
            Policy p;
            p.diag_tiles = diag;
            p.sink_tiles = sinks;
            const HighTiles high(p, qtile, tiles, ktile0);
            for (int j = 0; j < tiles; ++j, ++checked)
              ASSERT_EQ(high(j), p.is_high(qtile + ktile0, j + ktile0))
                  << "ktile0 " << ktile0 << " diag " << diag << " sinks " << sinks << " qtile " << qtile << " j " << j;
          }
  EXPECT_GT(checked, 500000);
}

TEST(AttentionCpu, DmaSitsBetweenItsFormats) {
  const FormatErrors e = format_errors(llm_like_qkv({1, 2, 1, 1024, 1024, 128}, 3), Policy::plain());
  EXPECT_LT(e.e8, e.dma);
  EXPECT_LT(e.dma, e.e4);
}

TEST(AttentionCpu, Bf16PolicyIsCloseToExactAndMxfp8WithinBound) {
  const QKV x = random_qkv({1, 2, 2, 257, 257, 128}, 4);
  AttentionOptions ex = opts({}, true);
  ex.exact = true;
  const std::vector<float> ref = run(x, ex).out;
  EXPECT_LE(rel_l2(run(x, opts(Policy::all(Format::bf16), true)).out, ref), 1e-2);
  // MXFP8 E4M3 on N(0,1) data: 3 mantissa bits on Q and K, bf16 P and V. Measured ~2.6e-2.
  const double e8 = rel_l2(run(x, opts(Policy::all(Format::mxfp8_e4m3), true)).out, ref);
  EXPECT_LE(e8, 4e-2);
  const double e4 = rel_l2(run(x, opts(Policy::all(Format::mxfp4), true)).out, ref);
  EXPECT_GT(e4, 2 * e8);
}

// pv = mxfp4 (V in MXFP4, P in MXFP8): V's 3 fewer mantissa bits must show in the output, and only
// through V: with Q and K in bf16 tiles its error vs exact is well above pv = mxfp8's, and of the size
// of V's own quantization error (E2M1 on N(0,1) values: ~0.1 rel. L2 per element, averaged by P).
TEST(AttentionCpu, Mxfp4ValuesCostMoreThanMxfp8) {
  const QKV x = random_qkv({1, 2, 1, 256, 256, 64}, 12);
  AttentionOptions ex = opts({}, true);
  ex.exact = true;
  const std::vector<float> ref = run(x, ex).out;
  double err[4];
  for (PV pv : {PV::bf16, PV::mxfp8, PV::mxfp4, PV::fp8}) {
    Policy pol = Policy::all(Format::bf16);
    pol.pv = pv;
    err[int(pv)] = rel_l2(run(x, opts(pol, true)).out, ref);
  }
  std::printf("pv bf16 %.3e, mxfp8 %.3e, mxfp4 %.3e, fp8 %.3e (rel. L2 vs exact, Q and K in bf16)\n", err[0], err[1],
              err[2], err[3]);
  EXPECT_LT(err[0], err[1]);
  EXPECT_GT(err[2], 3 * err[1]);
  EXPECT_LT(err[2], 0.2);
  // fp8: E4M3 like mxfp8, coarser scales (one a channel; P's fixed): the same order of error.
  EXPECT_LT(err[0], err[3]);
  EXPECT_LT(err[3], 3 * err[1]);
  for (PV pv : {PV::bf16, PV::mxfp8, PV::mxfp4, PV::fp8}) EXPECT_EQ(parse_pv(pv_name(pv)), pv);
}

// Every policy without smooth_k, whose key mean spans the call's keys, masked ones included (Policy):
// the default's tiles and rotation, and plain DMA.
TEST(AttentionCpu, CausalRowsIgnoreMaskedKeys) {
  for (PV pv : {PV::bf16, PV::mxfp8, PV::mxfp4, PV::fp8}) {
    for (bool plain : {false, true})
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{300, 300}, {100, 300}}) {
      QKV x = random_qkv({1, 2, 1, nq, nk, 64}, 5);
      Policy pol = plain ? Policy::plain() : Policy{};
      pol.smooth_k = false;
      pol.pv = pv;
      const Result before = run(x, opts(pol, true));
      // Perturb key n (and, for pv=bf16, its value). Rows at positions < n must not change.
      const int64_t n = nk - 60;
      std::vector<float> k = x.k.to_floats(), v = x.v.to_floats();
      for (int64_t i = 0; i < 64; ++i) {
        k[size_t(n * 64 + i)] += 100.0f;
        if (pv == PV::bf16) v[size_t(n * 64 + i)] -= 50.0f;
      }
      x.k = HostTensor::from_floats(k, x.k.shape());
      x.v = HostTensor::from_floats(v, x.v.shape());
      const Result after = run(x, opts(pol, true));
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t r = 0; r < nq; ++r) {
          const bool sees = r + nk - nq >= n;
          const size_t o = size_t((h * nq + r) * 64);
          const bool same = std::memcmp(&before.out[o], &after.out[o], 64 * sizeof(float)) == 0;
          EXPECT_EQ(same, !sees) << "pv " << int(pv) << (plain ? " plain" : " default tiles") << " row " << r;
        }
    }
  }
}

// Sliding windows: the exact reference equals the naive fp64 one, DMA stays within its causal
// error, and a key outside a row's window does not touch that row (windows that start mid-tile,
// one-sided and two-sided, causal and not).
TEST(AttentionCpu, SlidingWindowSeesOnlyItsKeys) {
  struct Case {
    int64_t nq, nk, left, right;
    bool causal;
  };
  for (const Case c : {Case{700, 700, 200, -1, true}, Case{300, 700, 0, -1, true}, Case{256, 256, 511, -1, true},
                       Case{200, 400, 90, 37, false}, Case{200, 400, -1, 10, false}}) {
    QKV x = random_qkv({1, 4, 2, c.nq, c.nk, 64}, uint64_t(c.nk + c.left));
    AttentionOptions e = opts(Policy{}, c.causal);
    e.exact = true;
    e.window_left = c.left;
    e.window_right = c.right;
    const std::vector<double> want = naive(x, c.causal, 1.0 / 8.0, c.left, c.right);
    const Result ex = run(x, e);
    std::vector<float> wantf(want.begin(), want.end());
    EXPECT_LT(rel_l2(ex.out, wantf), 1e-6) << c.left;
    AttentionOptions o = opts(Policy{}, c.causal);
    o.policy.smooth_k = false;  // its key mean spans every key of the call, outside the window too
    o.window_left = c.left;
    o.window_right = c.right;
    const Result dma = run(x, o);
    EXPECT_LT(rel_l2(dma.out, wantf), 0.2) << c.left;  // MXFP4 tiles on Gaussian inputs: ~0.1-0.15
    // Key n perturbed: exactly the rows whose window holds it change.
    const int64_t n = c.nk / 2 + 3;
    std::vector<float> k = x.k.to_floats();
    for (int64_t i = 0; i < 64; ++i) k[size_t(n * 64 + i)] += 30.0f;
    x.k = HostTensor::from_floats(k, x.k.shape());
    const Result after = run(x, o);
    for (int64_t r = 0; r < c.nq; ++r) {
      const int64_t pos = r + c.nk - c.nq;
      const bool sees = (!c.causal || n <= pos) && (c.left < 0 || n >= pos - c.left) && (c.right < 0 || n <= pos + c.right);
      const size_t off = size_t(r * 64);  // head 0 reads KV head 0
      EXPECT_EQ(std::memcmp(&dma.out[off], &after.out[off], 64 * sizeof(float)) != 0, sees) << "row " << r;
    }
  }
}

TEST(AttentionCpu, GqaEqualsRepeatedKvHeads) {
  const QKV x = random_qkv({2, 8, 2, 150, 150, 64}, 6);
  QKV rep;
  rep.q = x.q;
  const std::vector<float> k = x.k.to_floats(), v = x.v.to_floats();
  std::vector<float> k8, v8;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 8; ++h) {
      const size_t off = size_t((b * 2 + h / 4) * 150 * 64);
      k8.insert(k8.end(), k.begin() + long(off), k.begin() + long(off + 150 * 64));
      v8.insert(v8.end(), v.begin() + long(off), v.begin() + long(off + 150 * 64));
    }
  rep.k = HostTensor::from_floats(k8, {2, 8, 150, 64});
  rep.v = HostTensor::from_floats(v8, {2, 8, 150, 64});
  Policy pol;
  pol.pv = PV::mxfp8;
  EXPECT_TRUE(bit_equal(run(x, opts(pol, true)).out, run(rep, opts(pol, true)).out));
}

TEST(AttentionCpu, OddLengthsAgreeWithExact) {
  for (int64_t nq : {1, 127, 129, 1000})
    for (int64_t nk : {1, 127, 129, 1000})
      for (bool causal : {false, true}) {
        const QKV x = random_qkv({1, 1, 1, nq, nk, 64}, uint64_t(nq * 7 + nk));
        AttentionOptions ex = opts({}, causal);
        ex.exact = true;
        const Result ref = run(x, ex);
        const Result got = run(x, opts(Policy::all(Format::bf16), causal));
        const Result dma = run(x, opts(Policy{}, causal));
        for (float f : dma.out) ASSERT_FALSE(std::isnan(f)) << nq << "x" << nk;
        if (causal && nq > nk) {  // the first nq - nk rows see no key: zeros and lse = -inf
          for (int64_t r = 0; r < nq - nk; ++r) {
            EXPECT_EQ(got.out[size_t(r * 64)], 0.0f);
            EXPECT_EQ(got.lse[size_t(r)], -std::numeric_limits<float>::infinity());
            EXPECT_EQ(ref.lse[size_t(r)], -std::numeric_limits<float>::infinity());
          }
        }
        EXPECT_LE(rel_l2(got.out, ref.out), 1e-2) << nq << "x" << nk << " causal " << causal;
        EXPECT_LE(rel_l2(dma.out, ref.out), 0.3) << nq << "x" << nk << " causal " << causal;
        for (size_t i = 0; i < ref.lse.size(); ++i)
          if (std::isfinite(ref.lse[i])) EXPECT_NEAR(got.lse[i], ref.lse[i], 2e-2 + 2e-3 * std::fabs(ref.lse[i]));
      }
}

TEST(AttentionCpu, MergingKeyHalvesByLseEqualsWhole) {
  const int64_t nk = 512, split = 256, d = 64;
  const QKV x = random_qkv({1, 2, 1, 200, nk, d}, 8);
  auto half = [&](const HostTensor& t, int64_t from, int64_t to) {
    const std::vector<float> f = t.to_floats();
    return HostTensor::from_floats(std::vector<float>(f.begin() + from * d, f.begin() + to * d), {1, 1, to - from, d});
  };
  QKV a{x.q, half(x.k, 0, split), half(x.v, 0, split)}, b{x.q, half(x.k, split, nk), half(x.v, split, nk)};
  for (bool exact : {true, false}) {
    AttentionOptions o = opts(Policy::all(Format::mxfp4));
    o.exact = exact;
    const Result whole = run(x, o), ra = run(a, o), rb = run(b, o);
    std::vector<float> merged(whole.out.size()), lse(whole.lse.size());
    for (size_t r = 0; r < lse.size(); ++r) {
      const float m = std::max(ra.lse[r], rb.lse[r]);
      const float wa = std::exp(ra.lse[r] - m), wb = std::exp(rb.lse[r] - m);
      lse[r] = m + std::log(wa + wb);
      for (int64_t i = 0; i < d; ++i)
        merged[r * d + i] = (wa * ra.out[r * d + i] + wb * rb.out[r * d + i]) / (wa + wb);
    }
    // LSE uses unrounded fp32 p: it merges to fp32 accuracy. The DMA output rounds p to bf16
    // relative to the running max, which differs between the halves and the whole.
    EXPECT_LE(rel_l2(lse, whole.lse), 1e-6);
    EXPECT_LE(rel_l2(merged, whole.out), exact ? 1e-6 : 3e-3);
  }
}

TEST(AttentionCpu, DeterministicAcrossThreadCounts) {
  const QKV x = random_qkv({1, 4, 2, 700, 700, 128}, 9);
  Policy pol;
  pol.pv = PV::mxfp8;
  pol.sink_tiles = 1;
  AttentionOptions o = opts(pol, true);
  o.threads = 1;
  const Result one = run(x, o);
  for (int t : {2, 3, 8}) {
    o.threads = t;
    const Result many = run(x, o);
    EXPECT_TRUE(bit_equal(one.out, many.out)) << t;
    EXPECT_TRUE(bit_equal(one.lse, many.lse)) << t;
  }
}

TEST(AttentionCpu, Fp16AndBf16InputsAndOutputs) {
  const QKV x32 = random_qkv({1, 2, 1, 130, 130, 64}, 10);
  for (DType dt : {DType::f16, DType::bf16}) {
    const QKV x = random_qkv({1, 2, 1, 130, 130, 64}, 10, dt);
    HostTensor out(dt, x.q.shape());
    attention(x.q.view(), x.k.view(), x.v.view(), out.view(), nullptr, opts({}, true));
    const std::vector<float> ref = run(x32, opts({}, true)).out;
    EXPECT_LE(rel_l2(out.to_floats(), ref), 5e-2) << dtype_name(dt);
  }
}

TEST(AttentionCpu, RejectsBadInput) {
  const QKV x = random_qkv({1, 4, 2, 16, 16, 64}, 11);
  HostTensor out(DType::f32, x.q.shape());
  const QKV bad_heads = random_qkv({1, 3, 2, 16, 16, 64}, 11);
  HostTensor out3(DType::f32, bad_heads.q.shape());
  EXPECT_THROW(attention(bad_heads.q.view(), bad_heads.k.view(), bad_heads.v.view(), out3.view(), nullptr, {}), Error);
  const QKV bad_d = random_qkv({1, 1, 1, 16, 16, 48}, 11);
  HostTensor out48(DType::f32, bad_d.q.shape());
  EXPECT_THROW(attention(bad_d.q.view(), bad_d.k.view(), bad_d.v.view(), out48.view(), nullptr, {}), Error);
  EXPECT_THROW(attention(x.q.view(), x.k.view(), x.q.view(), out.view(), nullptr, {}), Error);  // V shape
  std::vector<float> q = x.q.to_floats();
  q[37] = std::numeric_limits<float>::infinity();
  const HostTensor qinf = HostTensor::from_floats(q, x.q.shape());
  EXPECT_THROW(attention(qinf.view(), x.k.view(), x.v.view(), out.view(), nullptr, {}), Error);
  q[37] = std::nanf("");
  const HostTensor qnan = HostTensor::from_floats(q, x.q.shape());
  EXPECT_THROW(attention(qnan.view(), x.k.view(), x.v.view(), out.view(), nullptr, {}), Error);
  AttentionOptions o;
  o.policy.diag_tiles = -1;
  EXPECT_THROW(attention(x.q.view(), x.k.view(), x.v.view(), out.view(), nullptr, o), Error);
  o = {};
  o.softmax_scale = 0.0f;
  EXPECT_THROW(attention(x.q.view(), x.k.view(), x.v.view(), out.view(), nullptr, o), Error);
  // Finite but huge inputs overflow the fp32 scores: an error, not NaN output.
  std::vector<float> big = x.k.to_floats();
  for (float& f : big) f = 3e30f;
  const HostTensor kbig = HostTensor::from_floats(big, x.k.shape());
  std::vector<float> qb = x.q.to_floats();
  for (float& f : qb) f = 3e30f;
  const HostTensor qbig = HostTensor::from_floats(qb, x.q.shape());
  o = {};
  o.policy = Policy::plain();  // (smooth_k would take these equal keys to zero)
  EXPECT_THROW(attention(qbig.view(), kbig.view(), x.v.view(), out.view(), nullptr, o), Error);
#if !defined(DMATTN_HAVE_CUDA)
  o = {};
  o.backend = Backend::cuda;
  EXPECT_THROW(attention(x.q.view(), x.k.view(), x.v.view(), out.view(), nullptr, o), Error);
#endif
}

// Real activations of SmolLM2-135M (tests/data, written by `dmattn capture --n 512 --layer 1
// --layer 20`): DMA sits between its formats, and sink tiles help, as on the real model.
TEST(AttentionCpu, RealActivationsOrderFormatsAndSinksHelp) {
  for (int layer : {1, 20}) {
    const std::string base = std::string(DMATTN_SOURCE_DIR) + "/tests/data/layer" + std::to_string(layer) + "_";
    const QKV x{read_npy_tensor(base + "q.npy", "q"), read_npy_tensor(base + "k.npy", "k"), read_npy_tensor(base + "v.npy", "v")};
    const FormatErrors e = format_errors(x, Policy::plain());
    const double e8 = e.e8, e4 = e.e4, dma = e.dma;
    Policy sink = Policy::plain();
    sink.sink_tiles = 1;
    const double dma_sink = format_errors(x, sink).dma;
    std::printf("layer %d: all-MXFP8 %.4f  all-MXFP4 %.4f  DMA %.4f  DMA+sink %.4f\n", layer, e8, e4, dma, dma_sink);
    EXPECT_LT(e8, dma) << layer;
    EXPECT_LT(dma, e4) << layer;
    EXPECT_LE(dma_sink, dma) << layer;
  }
}

// smooth_k removes K's channel mean: softmax-invariant, so outputs and (unshifted) LSE match exact
// attention; on keys with a large common offset it cuts the MX error sharply.
TEST(AttentionCpu, SmoothKIsSoftmaxInvariantAndHelpsOffsetKeys) {
  QKV x = random_qkv({1, 2, 1, 300, 300, 64}, 12);
  std::vector<float> k = x.k.to_floats();
  for (size_t i = 0; i < k.size(); ++i) k[i] += (i % 64 < 4) ? 20.0f : 0.0f;  // outlier channels
  x.k = HostTensor::from_floats(k, x.k.shape());
  AttentionOptions ex = opts({}, true);
  ex.exact = true;
  const Result ref = run(x, ex);
  Policy bf = Policy::all(Format::bf16);
  bf.smooth_k = true;
  const Result sm = run(x, opts(bf, true));
  EXPECT_LE(rel_l2(sm.out, ref.out), 1e-2);
  // bf16 Q/K move the LSE by ~1e-2; a missing q.mean(K) correction would move it by whole units.
  for (size_t i = 0; i < ref.lse.size(); ++i) EXPECT_NEAR(sm.lse[i], ref.lse[i], 5e-2);
  Policy f4 = Policy::all(Format::mxfp4);
  const double plain = rel_l2(run(x, opts(f4, true)).out, ref.out);
  f4.smooth_k = true;
  const double smooth = rel_l2(run(x, opts(f4, true)).out, ref.out);
  EXPECT_LT(smooth, 0.5 * plain);
}

// Explicit positions (AttentionOptions::q_offset / k_offset): a block of queries against a block of
// keys of a longer sequence. A query chunk against the whole key prefix reproduces the full call's
// rows bit for bit; key blocks merged by LSE reproduce them to bf16-P rounding.
TEST(Attention, PositionOffsetsDescribeBlocksOfALongerSequence) {
  const QKV x = random_qkv({1, 4, 2, 768, 768, 64}, 21);
  AttentionOptions o;
  o.causal = true;
  o.policy.smooth_k = false;  // its key mean is the call's: a block of keys has its own
  HostTensor full(DType::f32, x.q.shape());
  std::vector<float> full_lse(4 * 768);
  attention(x.q.view(), x.k.view(), x.v.view(), full.view(), full_lse.data(), o);
  const std::vector<float> f = full.to_floats();
  // Queries 256..511 against keys 0..511.
  const HostTensor q = HostTensor::copy_of(slice_tokens(x.q.view(), 256, 256));
  HostTensor out(DType::f32, q.shape());
  AttentionOptions ob = o;
  ob.q_offset = 256;
  ob.k_offset = 0;
  attention(q.view(), slice_tokens(x.k.view(), 0, 512), slice_tokens(x.v.view(), 0, 512), out.view(), nullptr, ob);
  const std::vector<float> g = out.to_floats();
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t i = 0; i < 256 * 64; ++i) ASSERT_EQ(g[size_t(h * 256 * 64 + i)], f[size_t((h * 768 + 256) * 64 + i)]);
  // Keys 128.. of the same rows as a second block, merged with keys 0..127 by LSE.
  HostTensor a(DType::f32, q.shape()), b(DType::f32, q.shape());
  std::vector<float> la(4 * 256), lb(4 * 256);
  ob.k_offset = 0;
  attention(q.view(), slice_tokens(x.k.view(), 0, 128), slice_tokens(x.v.view(), 0, 128), a.view(), la.data(), ob);
  ob.k_offset = 128;
  attention(q.view(), slice_tokens(x.k.view(), 128, 384), slice_tokens(x.v.view(), 128, 384), b.view(), lb.data(), ob);
  const std::vector<float> av = a.to_floats(), bv = b.to_floats();
  std::vector<float> merged(av.size());
  for (int64_t row = 0; row < 4 * 256; ++row) {
    const float m = std::max(la[size_t(row)], lb[size_t(row)]);
    const float wa = std::exp(la[size_t(row)] - m), wb = std::exp(lb[size_t(row)] - m);
    for (int64_t i = 0; i < 64; ++i)
      merged[size_t(row * 64 + i)] = (av[size_t(row * 64 + i)] * wa + bv[size_t(row * 64 + i)] * wb) / (wa + wb);
  }
  EXPECT_LT(compare(merged, g).rel_l2, 3e-3);  // measured 1.1e-3: P rounded to bf16 against each block's max
  ob.k_offset = 100;
  EXPECT_THROW(attention(q.view(), x.k.view(), x.v.view(), out.view(), nullptr, ob), Error);
}

// pv = fp8 written out for one key tile (Q and K in bf16, so the scores are plain dot products): P as
// E4M3(p * 2^8), each V channel as E4M3 codes under one power-of-two scale from its amax over the
// keys, out = sum(P codes * V codes) * scale / 2^8 / sum(p). And scaling one V channel by a power of
// two scales that output channel alone, exactly (its scale absorbs it).
TEST(AttentionCpu, PvFp8IsPerChannelE4M3) {
  const int64_t nq = 5, nk = 100, d = 32;
  QKV x = random_qkv({1, 1, 1, nq, nk, d}, 21);
  std::vector<float> v = x.v.to_floats();
  for (int64_t n = 0; n < nk; ++n) v[size_t(n * d + 3)] *= 1e-3f;  // channels of very different ranges
  for (int64_t n = 0; n < nk; ++n) v[size_t(n * d + 7)] *= 300.0f;
  x.v = HostTensor::from_floats(v, x.v.shape());
  Policy pol = Policy::all(Format::bf16);
  pol.pv = PV::fp8;
  pol.scale_rule = ScaleRule::ocp;  // the hand computation below applies the OCP rule
  const std::vector<float> got = run(x, opts(pol)).out;

  const std::vector<float> q = x.q.to_floats(), k = x.k.to_floats();
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> vs(static_cast<size_t>(d)), vc(v.size());
  for (int64_t i = 0; i < d; ++i) {
    float amax = 0.0f;
    for (int64_t n = 0; n < nk; ++n) amax = std::max(amax, std::fabs(v[size_t(n * d + i)]));
    const int e = int(std::floor(std::log2(amax))) - 8;  // OCP rule, E4M3's emax = 8
    vs[size_t(i)] = std::ldexp(1.0f, e);
    for (int64_t n = 0; n < nk; ++n)
      vc[size_t(n * d + i)] = decode_elem(Elem::e4m3, encode_elem(Elem::e4m3, std::ldexp(v[size_t(n * d + i)], -e)));
  }
  double e2 = 0, r2 = 0;
  for (int64_t r = 0; r < nq; ++r) {
    std::vector<float> s(static_cast<size_t>(nk));
    float m = -INFINITY;
    for (int64_t n = 0; n < nk; ++n) {
      float dot = 0;
      for (int64_t i = 0; i < d; ++i) dot += round_bf16(q[size_t(r * d + i)]) * round_bf16(k[size_t(n * d + i)]);
      s[size_t(n)] = dot * scale;
      m = std::max(m, s[size_t(n)]);
    }
    double l = 0;
    std::vector<double> o(static_cast<size_t>(d), 0.0);
    for (int64_t n = 0; n < nk; ++n) {
      const float p = std::exp(s[size_t(n)] - m);
      l += p;
      const float pe = decode_elem(Elem::e4m3, encode_elem(Elem::e4m3, p * 256.0f));
      for (int64_t i = 0; i < d; ++i) o[size_t(i)] += double(pe) * vc[size_t(n * d + i)];
    }
    for (int64_t i = 0; i < d; ++i) {
      const double want = o[size_t(i)] * vs[size_t(i)] / 256.0 / l, g = got[size_t(r * d + i)];
      e2 += (g - want) * (g - want);
      r2 += want * want;
    }
  }
  EXPECT_LT(std::sqrt(e2 / r2), 1e-5);

  for (int64_t n = 0; n < nk; ++n) v[size_t(n * d + 5)] *= 0.125f;
  x.v = HostTensor::from_floats(v, x.v.shape());
  const std::vector<float> scaled = run(x, opts(pol)).out;
  for (int64_t r = 0; r < nq; ++r)
    for (int64_t i = 0; i < d; ++i)
      EXPECT_EQ(scaled[size_t(r * d + i)], i == 5 ? got[size_t(r * d + i)] * 0.125f : got[size_t(r * d + i)]);
}

TEST(AttentionCpu, PvFp8IsRefusedWhereItsScalesCannotBeKnown) {
  Policy pol;
  pol.pv = PV::fp8;
  EXPECT_THROW(KVCache(1, 64, pol), Error);
}

// The accuracy transforms are exact in real arithmetic: with bf16 tiles (only rounding), each of
// them and all together reproduce exact attention, outputs and LSE, to bf16 tolerance. Causal and
// not, GQA, a ragged last query block, keys with a common offset and outlier channels.
TEST(AttentionCpu, AccuracyTransformsAreExactIdentities) {
  QKV x = random_qkv({2, 4, 2, 300, 333, 64}, 40);
  std::vector<float> q = x.q.to_floats(), k = x.k.to_floats();
  for (size_t i = 0; i < k.size(); ++i) k[i] += (i % 64 < 3) ? 12.0f : 1.5f;
  for (size_t i = 0; i < q.size(); ++i) q[i] += (i % 64 == 5) ? 6.0f : 0.7f;
  x.q = HostTensor::from_floats(q, x.q.shape());
  x.k = HostTensor::from_floats(k, x.k.shape());
  for (bool causal : {true, false}) {
    AttentionOptions ex = opts({}, causal);
    ex.exact = true;
    const Result ref = run(x, ex);
    for (int t = 0; t < 5; ++t) {
      Policy p = Policy::all(Format::bf16);
      p.smooth_k = t == 0 || t == 4;
      p.smooth_q = t == 1 || t == 4 ? SmoothQ::all : SmoothQ::off;
      p.rotate = t == 2 || t == 4;
      p.sink_keys = t == 3 || t == 4 ? 3 : 0;
      const Result r = run(x, opts(p, causal));
      EXPECT_LE(rel_l2(r.out, ref.out), 1e-2) << p.describe() << " causal " << causal;
      for (size_t i = 0; i < ref.lse.size(); ++i) ASSERT_NEAR(r.lse[i], ref.lse[i], 0.1) << p.describe() << " row " << i;
    }
  }
}

// What each transform is for, on inputs that show it: smooth_q on queries with a large common part,
// rotate on a real layer's outlier channels, sink_keys on the score of a row's only key.
TEST(AttentionCpu, AccuracyTransformsCutTheErrorTheyTarget) {
  AttentionOptions ex = opts({}, true);
  ex.exact = true;
  auto err = [&](const QKV& x, Policy p) { return rel_l2(run(x, opts(p, true)).out, run(x, ex).out); };
  const Policy f4 = Policy::all(Format::mxfp4);
  Policy t = f4;

  QKV common = random_qkv({1, 2, 1, 256, 256, 64}, 41);
  std::vector<float> q = common.q.to_floats();
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.3f * q[i] + ((i % 64) % 3 == 0 ? 2.0f : -1.0f);
  common.q = HostTensor::from_floats(q, common.q.shape());
  t.smooth_q = SmoothQ::all;
  EXPECT_LT(err(common, t), 0.5 * err(common, f4));

  // Real keys: a few channels carry most of K's energy (layer 20 of SmolLM2, tests/data).
  const std::string base = std::string(DMATTN_SOURCE_DIR) + "/tests/data/layer20_";
  const QKV real{read_npy_tensor(base + "q.npy", "q"), read_npy_tensor(base + "k.npy", "k"), read_npy_tensor(base + "v.npy", "v")};
  t = f4;
  t.rotate = true;
  EXPECT_LT(err(real, t), 0.8 * err(real, f4));

  // Row 0 sees key 0 alone: its LSE is that one scaled score, q.k in fp32 with sink_keys (k as
  // transformed rows are kept: in bf16).
  const QKV x = random_qkv({1, 1, 1, 130, 130, 64}, 43);
  t = f4;
  t.sink_keys = 1;
  const std::vector<float> q0 = x.q.to_floats(), k0 = x.k.to_floats();
  double dot = 0;
  for (int i = 0; i < 64; ++i) dot += double(q0[size_t(i)]) * round_bf16(k0[size_t(i)]);
  EXPECT_NEAR(run(x, opts(t, true)).lse[0], dot / 8.0, 1e-5 * (1 + std::fabs(dot)));
  EXPECT_GT(std::fabs(run(x, opts(f4, true)).lse[0] - dot / 8.0), 1e-3);
}

// On SmolLM2's real activations, the transforms together cut the default policy's error.
TEST(AttentionCpu, AccuracyTransformsHelpOnRealActivations) {
  for (int layer : {1, 20}) {
    const std::string base = std::string(DMATTN_SOURCE_DIR) + "/tests/data/layer" + std::to_string(layer) + "_";
    const QKV x{read_npy_tensor(base + "q.npy", "q"), read_npy_tensor(base + "k.npy", "k"), read_npy_tensor(base + "v.npy", "v")};
    Policy plain;
    plain.smooth_k = plain.rotate = false;
    plain.sink_keys = 0;
    Policy all = plain;
    all.smooth_k = all.rotate = true;
    all.smooth_q = SmoothQ::all;
    all.sink_keys = 1;
    all.sink_tiles = 1;
    const FormatErrors e = format_errors(x, plain);
    const double with = format_errors(x, all).dma;
    std::printf("layer %d: default %.4f  with transforms %.4f\n", layer, e.dma, with);
    EXPECT_LT(with, 0.6 * e.dma) << layer;
  }
}

// q_residual gives the high tiles' queries a second E4M3 term (their residual at the row's scale).
// Where K is exact in MXFP8 (small integers), Q's rounding is a high tile's only error: the second
// term takes Q from E4M3's 4 significant bits to about 8, so every tile high errs a fraction as
// much; with no high tile it changes nothing, bit for bit; one tile format refuses it.
TEST(AttentionCpu, QResidualRefinesTheHighTilesQueries) {
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  QKV x = random_qkv({1, 2, 1, 300, 300, 64}, 46, DType::bf16);
  std::vector<float> k = x.k.to_floats();
  for (size_t i = 0; i < k.size(); ++i) k[i] = float(int(i * 7919 % 17) - 8);  // integers in [-8, 8]: exact E4M3
  x.k = HostTensor::from_floats(k, x.k.shape(), DType::bf16);
  AttentionOptions ex = opts({}, true);
  ex.exact = true;
  const Result want = run(x, ex);
  auto with = [](Policy p) {
    p.q_residual = true;
    return p;
  };
  const Policy every = Policy::tiles(e4, f4, 100, 0), none = Policy::tiles(e4, f4, 0, 0);
  const double one = rel_l2(run(x, opts(every, true)).out, want.out), two = rel_l2(run(x, opts(with(every), true)).out, want.out);
  std::printf("every tile MXFP8, K exact: Q in one term %.2e, in two %.2e\n", one, two);
  EXPECT_GT(one, 1e-3);
  EXPECT_LT(two, 0.15 * one);
  EXPECT_EQ(run(x, opts(with(none), true)).out, run(x, opts(none, true)).out);
  EXPECT_THROW(with(Policy::all(e4)).validate(), Error);
}

// smooth_q's mean spans all of a head's queries in the call: where every row of a head is the same
// vector (one per head, several query tiles), q - mu is exactly zero and each score is mu.k' in
// fp32, so MXFP4 tiles give the same output, bit for bit, as bf16 tiles (the scores are equal and
// P.V is bf16 in both). Without smooth_q the MXFP4 scores differ.
TEST(AttentionCpu, SmoothQMeanSpansTheHeadsQueries) {
  QKV x = random_qkv({2, 4, 2, 300, 333, 64}, 44);
  std::vector<float> q = x.q.to_floats();
  for (size_t i = 0; i < q.size(); ++i) {
    const size_t bh = i / (300 * 64), c = i % 64;  // one vector per (batch, head) across its 300 rows
    q[i] = round_bf16(0.25f * float((bh * 7 + c * 3) % 11) - 1.2f);
  }
  x.q = HostTensor::from_floats(q, x.q.shape());
  for (bool causal : {true, false}) {
    Policy four = Policy::all(Format::mxfp4), bf = Policy::all(Format::bf16);
    four.smooth_q = bf.smooth_q = SmoothQ::all;
    four.smooth_k = bf.smooth_k = false;
    for (bool rotate : {false, true}) {
      four.rotate = bf.rotate = rotate;
      const Result a = run(x, opts(four, causal)), b = run(x, opts(bf, causal));
      for (size_t i = 0; i < a.out.size(); ++i) ASSERT_EQ(a.out[i], b.out[i]) << "rotate " << rotate << " at " << i;
    }
    Policy plain = Policy::all(Format::mxfp4);
    plain.smooth_k = plain.rotate = false;
    EXPECT_GT(rel_l2(run(x, opts(plain, causal)).out, run(x, opts(bf, causal)).out), 1e-3);
  }
}

// smooth_q=high centres the queries of the high tiles alone, each high tile with its correction:
// with no high tile it is smooth_q off, with every tile high smooth_q on every tile, bit for bit.
// Where every row of a head is one vector, q - mu = 0, so a high tile's scores are mu.k' in fp32
// whatever its format: the high format then changes nothing, while the low tiles' queries, not
// centred, still carry their rounding.
TEST(AttentionCpu, SmoothQHighCentresTheHighTilesAlone) {
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  // bf16 inputs: rounding the transformed rows to bf16 changes nothing.
  QKV x = random_qkv({1, 4, 2, 600, 600, 64}, 45, DType::bf16);
  std::vector<float> q = x.q.to_floats();
  for (size_t i = 0; i < q.size(); ++i) q[i] += (i % 64) % 3 == 0 ? 2.0f : -1.0f;  // a common part
  x.q = HostTensor::from_floats(q, x.q.shape(), DType::bf16);
  auto with = [](Policy p, SmoothQ s) {
    p.smooth_q = s;
    return p;
  };
  for (bool causal : {true, false}) {
    const Policy none = Policy::tiles(e4, f4, 0, 0), every = Policy::tiles(e4, f4, 100, 0), band = Policy::tiles(e4, f4, 2, 1);
    EXPECT_EQ(run(x, opts(with(none, SmoothQ::high), causal)).out, run(x, opts(none, causal)).out);
    EXPECT_EQ(run(x, opts(with(every, SmoothQ::high), causal)).out, run(x, opts(with(every, SmoothQ::all), causal)).out);
    const Result h = run(x, opts(with(band, SmoothQ::high), causal));
    EXPECT_GT(rel_l2(h.out, run(x, opts(band, causal)).out), 1e-4);
    EXPECT_GT(rel_l2(h.out, run(x, opts(with(band, SmoothQ::all), causal)).out), 1e-4);
  }

  for (size_t i = 0; i < q.size(); ++i) {
    const size_t bh = i / (600 * 64), c = i % 64;  // one vector per head across its 600 rows
    q[i] = round_bf16(0.25f * float((bh * 5 + c * 3) % 11) - 1.2f);
  }
  x.q = HostTensor::from_floats(q, x.q.shape(), DType::bf16);
  for (bool causal : {true, false}) {
    const Result a = run(x, opts(with(Policy::tiles(f4, e4, 2, 1), SmoothQ::high), causal));
    const Result b = run(x, opts(with(Policy::tiles(Format::bf16, e4, 2, 1), SmoothQ::high), causal));
    EXPECT_EQ(a.out, b.out);
    EXPECT_EQ(a.lse, b.lse);
    EXPECT_GT(rel_l2(a.out, run(x, opts(Policy::tiles(f4, e4, 2, 1), causal)).out), 1e-4);
  }
  // One tile format: no low tiles to leave uncentred.
  EXPECT_THROW(run(x, opts(with(Policy::all(e4), SmoothQ::high), true)), Error);
}
