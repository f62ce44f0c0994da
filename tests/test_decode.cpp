// KV cache and decode (CPU): decode equals the prefill path's last rows on the same cache contents
// (bit for bit with one split), split-KV merges within bf16-P rounding, ragged batches, page tables
// with holes, length-1 sequences, memory accounting, re-encoding, and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "cuda/decode/splits.hpp"
#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/npy.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {


// Appends k/v to a new sequence of `cache` in chunks of the given sizes (then the rest).
int fill(KVCache& cache, const QKV& x, std::vector<int64_t> chunks) {
  const int s = cache.new_sequence();
  const int64_t L = x.k.shape()[2];
  int64_t t = 0;
  for (size_t i = 0; t < L; ++i) {
    const int64_t n = i < chunks.size() ? std::min(chunks[i], L - t) : L - t;
    cache.append(s, slice_tokens(x.k.view(), t, n), slice_tokens(x.v.view(), t, n));
    t += n;
  }
  return s;
}

// LLM-like keys and values of length L and the last nq of its queries (positions L-nq..L-1).
QKV problem(int64_t hq, int64_t hkv, int64_t nq, int64_t L, int64_t d, uint64_t seed) {
  QKV x = llm_like_qkv({1, hq, hkv, L, L, d}, seed);
  return QKV{HostTensor::copy_of(slice_tokens(x.q.view(), L - nq, nq)), std::move(x.k), std::move(x.v)};
}

struct Out {
  HostTensor out;
  std::vector<float> lse;
};

Out prefill(const QKV& x, const Policy& pol, int64_t window_left = -1) {
  AttentionOptions o;
  o.causal = true;
  o.policy = pol;
  o.window_left = window_left;
  Out r{HostTensor(DType::f32, x.q.shape()), std::vector<float>(size_t(x.q.shape()[1] * x.q.shape()[2]))};
  attention(x.q.view(), x.k.view(), x.v.view(), r.out.view(), r.lse.data(), o);
  return r;
}

Out decode(const KVCache& cache, int seq, const HostTensor& q, int splits = 1, int64_t window_left = -1) {
  Out r{HostTensor(DType::f32, q.shape()), std::vector<float>(size_t(q.shape()[1] * q.shape()[2]))};
  DecodeOptions o;
  o.splits = splits;
  o.window_left = window_left;
  decode_attention(cache, {seq}, q.view(), r.out.view(), r.lse.data(), o);
  return r;
}


}  // namespace

TEST(Decode, EqualsPrefillLastRowsBitForBit) {
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  Policy pv8 = Policy::tiles(e4, f4, 1, 1);
  pv8.pv = PV::mxfp8;  // V in 32-key MXFP8 blocks: the open block is re-quantized as tokens arrive
  Policy pv4 = pv8;
  pv4.pv = PV::mxfp4;  // V in 32-key MXFP4 blocks, two channels a byte
  // The default without smooth_k: the cache's key mean is its first append's, here a single token.
  Policy tiles_rot;
  tiles_rot.smooth_k = false;
  Policy residual = Policy::tiles(e4, f4, 2, 1);
  residual.q_residual = true;  // the high pages' queries in two terms, as prefill's high tiles'
  const Policy pols[] = {Policy::plain(), tiles_rot, Policy::tiles(e4, f4, 2, 1), Policy::tiles(e4, f4, 0, 0),
                         Policy::tiles(Format::mxfp6_e2m3, Format::mxfp8_e5m2, 1, 0), pv8, pv4, residual};
  int checked = 0;
  for (int64_t L : {1, 77, 128, 129, 300, 1000})
    for (int64_t nq : {1, 4, 16}) {
      if (nq > L || (L - nq) / kTile != (L - 1) / kTile) continue;  // queries in the newest tile only
      for (const Policy& pol : pols) {
        const QKV x = problem(4, 2, nq, L, 64, uint64_t(L * 31 + nq));
        KVCache cache(2, 64, pol);
        const int s = fill(cache, x, {1, 50, 129});
        ASSERT_EQ(cache.length(s), L);
        const Out want = prefill(x, pol), got = decode(cache, s, x.q);
        ASSERT_EQ(got.out.to_floats(), want.out.to_floats()) << "L=" << L << " Nq=" << nq << " " << pol.describe();
        ASSERT_EQ(got.lse, want.lse) << "L=" << L << " Nq=" << nq;
        ++checked;
      }
    }
  EXPECT_GE(checked, 50);
}

// A sliding window: decode skips the pages before every row's window and masks the rest as prefill
// does, so it equals prefill's last rows with the same window bit for bit; windows narrower than a
// page, ending mid-page, wider than the sequence, and zero (each query sees itself alone).
TEST(Decode, SlidingWindowEqualsPrefillLastRowsBitForBit) {
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  Policy sinks = Policy::tiles(e4, f4, 1, 1);
  sinks.sink_keys = 3;
  int checked = 0;
  for (int64_t L : {77, 300, 1000})
    for (int64_t nq : {1, 4})
      for (int64_t left : {0, 5, 100, 200, 600, 5000})
        for (const Policy& pol : {Policy{}, sinks}) {
          const QKV x = problem(4, 2, nq, L, 64, uint64_t(L * 7 + nq + left));
          KVCache cache(2, 64, pol);
          const int s = fill(cache, x, {L});
          const Out want = prefill(x, pol, left), got = decode(cache, s, x.q, 1, left);
          ASSERT_EQ(got.out.to_floats(), want.out.to_floats()) << "L=" << L << " Nq=" << nq << " left=" << left;
          ASSERT_EQ(got.lse, want.lse) << "L=" << L << " Nq=" << nq << " left=" << left;
          ++checked;
        }
  EXPECT_EQ(checked, 72);
  // The window does change the result where it is shorter than the sequence.
  const QKV x = problem(4, 2, 1, 1000, 64, 5);
  KVCache cache(2, 64, Policy{});
  const int s = fill(cache, x, {1000});
  EXPECT_NE(decode(cache, s, x.q, 1, 200).lse, decode(cache, s, x.q).lse);
}

// The accuracy transforms in the cache: with the prompt appended whole (smooth_k's mean is the
// first append's), decode equals prefill's last rows bit for bit, LSE included, over later
// single-token appends too.
TEST(Decode, TransformsEqualPrefillLastRowsBitForBit) {
  const Format e4 = Format::mxfp8_e4m3, f4 = Format::mxfp4;
  std::vector<Policy> pols;
  for (int mask = 1; mask < 8; ++mask) {
    Policy p = Policy::tiles(e4, f4, 1 + (mask & 1), mask >> 2);
    p.rotate = mask & 1;
    p.smooth_k = mask & 2;
    p.sink_keys = mask & 4 ? 3 : 0;
    pols.push_back(p);
  }
  Policy pv4 = pols.back();
  pv4.pv = PV::mxfp4;
  pols.push_back(pv4);
  Policy many = pols.back();
  many.sink_keys = 200;  // more than a page
  pols.push_back(many);
  int checked = 0;
  for (int64_t L : {1, 5, 200, 300})
    for (int64_t nq : {1, 4}) {
      if (nq > L || (L - nq) / kTile != (L - 1) / kTile) continue;
      for (const Policy& pol : pols) {
        const QKV x = problem(4, 2, nq, L, 64, uint64_t(L * 7 + nq));
        KVCache cache(2, 64, pol);
        const int s = fill(cache, x, {std::max<int64_t>(L - 2, 1), 1, 1});  // the prompt, then tokens one by one
        const Out want = prefill(x, pol), got = decode(cache, s, x.q);
        if (pol.smooth_k && L > 2) {
          // The mean is the first append's (L - 2 tokens), not prefill's over L: close, not equal.
          EXPECT_LT(compare(got.out.to_floats(), want.out.to_floats()).rel_l2, 0.05) << pol.describe();
          continue;
        }
        ASSERT_EQ(got.out.to_floats(), want.out.to_floats()) << "L=" << L << " Nq=" << nq << " " << pol.describe();
        ASSERT_EQ(got.lse, want.lse) << "L=" << L << " Nq=" << nq << " " << pol.describe();
        ++checked;
      }
      for (const Policy& pol : pols) {  // the whole sequence in one append: smooth_k's mean is prefill's
        if (!pol.smooth_k) continue;
        const QKV x = problem(4, 2, nq, L, 64, uint64_t(L * 7 + nq));
        KVCache cache(2, 64, pol);
        const int s = fill(cache, x, {});
        const Out want = prefill(x, pol), got = decode(cache, s, x.q);
        ASSERT_EQ(got.out.to_floats(), want.out.to_floats()) << "L=" << L << " Nq=" << nq << " " << pol.describe();
        ASSERT_EQ(got.lse, want.lse) << "L=" << L << " Nq=" << nq << " " << pol.describe();
        ++checked;
      }
    }
  EXPECT_GE(checked, 40);
}

// What the cache keeps for the transforms: smooth_k's mean is the first append's, sink rows the
// first keys as quantized, both in the byte count; smooth_q is prefill-only (decode is unchanged by it).
TEST(Decode, TransformStateOfTheCache) {
  const QKV x = problem(4, 2, 1, 40, 64, 11);
  Policy pol = Policy::plain();
  pol.smooth_k = true;
  pol.sink_keys = 2;
  KVCache cache(2, 64, pol);
  const int s = fill(cache, x, {10, 30});
  const std::vector<float> k = x.k.to_floats();  // [1][2][40][64]
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 64; i += 13) {
      double m = 0;
      for (int t = 0; t < 10; ++t) m += k[size_t((h * 40 + t) * 64 + i)];
      EXPECT_FLOAT_EQ(cache.key_mean(s)[size_t(h * 64 + i)], float(m / 10));
      const float centred = k[size_t((h * 40 + 1) * 64 + i)] - cache.key_mean(s)[size_t(h * 64 + i)];
      EXPECT_EQ(cache.sink_rows(s)[size_t((h * 2 + 1) * 64 + i)], round_bf16(centred));
    }
  KVCache plain(2, 64, Policy::plain());
  const int p = fill(plain, x, {10, 30});
  EXPECT_EQ(cache.bytes(s), plain.bytes(p) + (2 * 64 + 2 * 2 * 64) * sizeof(float));

  // bf16 inputs, so rounding transformed rows changes nothing: smooth_q's decode is the plain one.
  const QKV b = llm_like_qkv({1, 4, 2, 40, 40, 64}, 12, DType::bf16);
  const HostTensor q = HostTensor::copy_of(slice_tokens(b.q.view(), 39, 1));
  Policy sq = Policy::plain();
  sq.smooth_q = SmoothQ::all;
  KVCache smoothed(2, 64, sq), none(2, 64, Policy::plain());
  const int a = fill(smoothed, b, {}), c = fill(none, b, {});
  EXPECT_EQ(decode(smoothed, a, q).out.to_floats(), decode(none, c, q).out.to_floats());
}

TEST(Decode, SplitKvMergesByLse) {
  const QKV x = problem(8, 2, 4, 1000, 128, 5);
  Policy pv8{};
  pv8.pv = PV::mxfp8;
  for (const Policy& pol : {Policy{}, pv8}) {
    KVCache cache(2, 128, pol);
    const int s = fill(cache, x, {});
    const Out one = decode(cache, s, x.q, 1);
    for (int splits : {2, 3, 8, 100}) {
      const Out many = decode(cache, s, x.q, splits);
      const double rel = compare(many.out.to_floats(), one.out.to_floats()).rel_l2;
      std::printf("pv=%s splits=%d: rel. L2 vs one split %.2e\n", pol.pv == PV::mxfp8 ? "mxfp8" : "bf16", splits, rel);
      // P is rounded relative to each split's own maximum: to bf16, or with pv = mxfp8 to E4M3 (3
      // mantissa bits), whence the GPU decode's bounds for automatic splits.
      EXPECT_LT(rel, pol.pv == PV::mxfp8 ? 2e-2 : 5e-3);
      EXPECT_GT(rel, 0.0);  // ... so it does change (the merge is not a no-op)
      for (size_t i = 0; i < one.lse.size(); ++i) EXPECT_NEAR(many.lse[i], one.lse[i], 1e-5 * (1 + std::fabs(one.lse[i])));
    }
  }
}

TEST(Decode, RaggedBatchWithPageTablesWithHoles) {
  const Policy pol = Policy::tiles(Format::mxfp8_e4m3, Format::mxfp4, 1, 1);
  KVCache cache(2, 64, pol);
  const int64_t lens[3] = {700, 300, 901};
  std::vector<QKV> xs;
  for (int i = 0; i < 3; ++i) xs.push_back(problem(6, 2, 3, lens[i], 64, uint64_t(100 + i)));
  int ids[3];
  for (int i = 0; i < 3; ++i) ids[i] = cache.new_sequence();
  // Interleaved appends, so each sequence's pages are scattered through the pool.
  for (int64_t t = 0; t < 901; t += 100)
    for (int i = 0; i < 3; ++i)
      if (t < lens[i]) {
        const int64_t n = std::min<int64_t>(100, lens[i] - t);
        cache.append(ids[i], slice_tokens(xs[size_t(i)].k.view(), t, n), slice_tokens(xs[size_t(i)].v.view(), t, n));
      }
  cache.free_sequence(ids[1]);  // its pages go back to the pool ...
  const QKV extra = problem(6, 2, 3, 1300, 64, 200);
  const int late = fill(cache, extra, {});  // ... and are reused here: a table with holes in between
  bool gap = false;
  const auto& table = cache.page_table(late);
  for (size_t i = 1; i < table.size(); ++i) gap |= table[i] != table[i - 1] + 1;
  EXPECT_TRUE(gap);
  // One batch over sequences of different lengths; each row equals its own sequence's prefill.
  const std::vector<int> batch = {ids[0], late, ids[2]};
  const QKV* src[3] = {&xs[0], &extra, &xs[2]};
  std::vector<float> qall;
  for (const QKV* x : src) {
    const std::vector<float> q = x->q.to_floats();
    qall.insert(qall.end(), q.begin(), q.end());
  }
  const HostTensor q = HostTensor::from_floats(qall, {3, 6, 3, 64});
  HostTensor out(DType::f32, q.shape());
  decode_attention(cache, batch, q.view(), out.view(), nullptr);
  const std::vector<float> got = out.to_floats();
  for (int i = 0; i < 3; ++i) {
    const std::vector<float> want = prefill(*src[i], pol).out.to_floats();
    ASSERT_EQ(std::vector<float>(got.begin() + i * int64_t(want.size()), got.begin() + (i + 1) * int64_t(want.size())), want)
        << "sequence " << i;
  }
}

TEST(Decode, LengthOneReturnsTheValue) {
  const QKV x = random_qkv({1, 2, 1, 1, 1, 32}, 9);
  KVCache cache(1, 32, Policy{});
  const int s = fill(cache, x, {});
  const Out r = decode(cache, s, x.q);
  const std::vector<float> v = x.v.to_floats(), o = r.out.to_floats();
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 32; ++i) EXPECT_EQ(o[size_t(h * 32 + i)], round_bf16(v[size_t(i)]));
}

TEST(Decode, MemoryAndReencoding) {
  const int64_t L = 1024, d = 128, H = 2;
  const QKV x = problem(4, H, 1, L, d, 11);
  KVCache cache(H, d, Policy::plain());  // (bytes of the plain policy: one high page)
  const int s = fill(cache, x, {});
  // 8 pages: 7 low (MXFP4: d/2 code bytes + d/32 scales per row), the newest high (MXFP8: d + d/32)
  // with its fp32 originals kept for the re-encoding ahead; V in bf16 everywhere.
  const size_t rows = size_t(H * kTile);
  const size_t want = 7 * rows * (d / 2 + d / 32 + 2 * d) + rows * (d + d / 32 + 2 * d + 4 * d);
  EXPECT_EQ(cache.bytes(s), want);
  const double bf16_kv = double(L * H * d * 2 * 2);
  std::printf("KV cache, L=%lld d=%lld Hkv=%lld: %zu bytes = %.3f of a bf16 K+V cache (K alone: %.3f)\n", (long long)L,
              (long long)d, (long long)H, cache.bytes(s), double(cache.bytes(s)) / bf16_kv,
              double(cache.bytes(s) - L * H * d * 2) / (bf16_kv / 2));
  // pv = mxfp8: V at 8 bits + one scale byte per 32 keys and channel, plus the open block's originals.
  Policy pv8 = Policy::plain();
  pv8.pv = PV::mxfp8;
  KVCache small_v(H, d, pv8);
  const int s8 = fill(small_v, x, {});
  EXPECT_EQ(small_v.bytes(s8), want - size_t(8) * rows * d * 2 + size_t(8) * rows * (d + d / 32));
  std::printf("with pv = mxfp8: %zu bytes = %.3f of a bf16 K+V cache\n", small_v.bytes(s8),
              double(small_v.bytes(s8)) / bf16_kv);
  // pv = mxfp4: V at 4 bits (two channels a byte) + the same scales.
  Policy pv4 = Policy::plain();
  pv4.pv = PV::mxfp4;
  KVCache v4(H, d, pv4);
  const int s4 = fill(v4, x, {});
  EXPECT_EQ(v4.bytes(s4), want - size_t(8) * rows * d * 2 + size_t(8) * rows * (d / 2 + d / 32));
  std::printf("with pv = mxfp4: %zu bytes = %.3f of a bf16 K+V cache\n", v4.bytes(s4), double(v4.bytes(s4)) / bf16_kv);
  // Re-encoding from retained originals reproduces prefill; from the MXFP8 values it rounds twice.
  KVCache twice(H, d, Policy::plain());
  twice.reencode_from_high = true;
  const int s2 = fill(twice, x, {});
  const Out want_out = prefill(x, Policy::plain());
  const Out a = decode(cache, s, x.q), b = decode(twice, s2, x.q);
  EXPECT_EQ(a.out.to_floats(), want_out.out.to_floats());
  const double rel = compare(b.out.to_floats(), want_out.out.to_floats()).rel_l2;
  std::printf("re-encoding MXFP4 from MXFP8 values instead of the originals: rel. L2 %.2e vs prefill\n", rel);
  EXPECT_GT(rel, 0.0);
  EXPECT_LT(rel, 0.1);
}

TEST(Decode, RejectsWhatItCannotDo) {
  EXPECT_THROW(KVCache(2, 64, Policy::tiles(Format::mxfp8_e4m3, Format::nvfp4, 1, 0)), Error);
  Policy many_sinks;
  many_sinks.sink_keys = 100000;  // retained in fp32: the cache caps them
  EXPECT_THROW(KVCache(2, 64, many_sinks), Error);
  Policy pv_fp8;
  pv_fp8.pv = PV::fp8;
  EXPECT_THROW(KVCache(2, 64, pv_fp8), Error);
  EXPECT_THROW(KVCache(2, 48, Policy{}), Error);
  const QKV x = random_qkv({1, 4, 2, 17, 300, 64}, 3);
  KVCache cache(2, 64, Policy{});
  const int s = fill(cache, x, {});
  HostTensor out(DType::f32, x.q.shape());
  EXPECT_THROW(decode_attention(cache, {s}, x.q.view(), out.view(), nullptr), Error);  // Nq = 17 > 16
  const QKV y = random_qkv({1, 3, 2, 1, 10, 64}, 4);
  HostTensor out3(DType::f32, y.q.shape());
  EXPECT_THROW(decode_attention(cache, {s}, y.q.view(), out3.view(), nullptr), Error);  // 3 heads over 2
  const QKV z = random_qkv({1, 4, 2, 8, 4, 64}, 5);
  KVCache small(2, 64, Policy{});
  const int t = fill(small, z, {});
  HostTensor out8(DType::f32, z.q.shape());
  EXPECT_THROW(decode_attention(small, {t}, z.q.view(), out8.view(), nullptr), Error);  // 8 queries, 4 tokens
  std::vector<float> bad = z.k.to_floats();
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  const HostTensor kbad = HostTensor::from_floats(bad, z.k.shape());
  EXPECT_THROW(small.append(t, kbad.view(), z.v.view()), Error);
  EXPECT_EQ(small.length(t), 4);  // unchanged
  EXPECT_THROW(small.length(99), Error);
}

// Token-by-token generation over the real model's layer-20 activations (SmolLM2, 512 tokens): with
// pv = bf16 every step's decode equals that row of the full prefill, so decode quality is exactly the
// prefill tables' (bench/RESULTS.md). With pv = mxfp8 it cannot: full prefill quantizes each 32-key V
// block with the keys after the row (the pv = mxfp8 leak of docs/DESIGN.md), generation only with those it has;
// the test measures that gap (each step still equals prefill over the same Nk: EqualsPrefillLastRows).
TEST(Decode, TokenByTokenEqualsPrefillOnRealActivations) {
  const std::string base = std::string(DMATTN_SOURCE_DIR) + "/tests/data/layer20_";
  const QKV x{read_npy_tensor(base + "q.npy", "q"), read_npy_tensor(base + "k.npy", "k"),
              read_npy_tensor(base + "v.npy", "v")};
  const int64_t Hq = x.q.shape()[1], Hkv = x.k.shape()[1], N = x.k.shape()[2], d = x.k.shape()[3];
  Policy pv8 = Policy::plain(), tiles_rot;
  pv8.pv = PV::mxfp8;
  tiles_rot.smooth_k = false;  // the default without smooth_k, whose mean here would be the first token's
  for (const Policy& pol : {Policy::plain(), tiles_rot, Policy::tiles(Format::mxfp8_e4m3, Format::mxfp4, 1, 1), pv8}) {
    const std::vector<float> wo = prefill(x, pol).out.to_floats();
    std::vector<float> gen(wo.size());
    KVCache cache(Hkv, d, pol);
    const int s = cache.new_sequence();
    for (int64_t t = 0; t < N; ++t) {
      cache.append(s, slice_tokens(x.k.view(), t, 1), slice_tokens(x.v.view(), t, 1));
      const HostTensor q = HostTensor::copy_of(slice_tokens(x.q.view(), t, 1));
      const std::vector<float> got = decode(cache, s, q).out.to_floats();
      for (int64_t h = 0; h < Hq; ++h)
        std::copy(got.begin() + h * d, got.begin() + (h + 1) * d, gen.begin() + (h * N + t) * d);
    }
    if (pol.pv == PV::bf16) {
      EXPECT_EQ(gen, wo) << pol.describe();
    } else {
      const double rel = compare(gen, wo).rel_l2;
      std::printf("pv = mxfp8: generation vs full prefill (V blocks without / with later keys): rel. L2 %.2e\n", rel);
      EXPECT_GT(rel, 0.0);
      EXPECT_LT(rel, 0.05);
    }
  }
}

// The GPU decode's instance and splits (plain C++): three CTAs an SM where the grid then fills the GPU
// in one wave (B=16 x Hkv=8 at 32k, where three measured faster), two where three would cost a wave more than
// the SM rate gives back (B=64 at 8k, B=1 at 32k, where a fixed three ran slower), and
// two wherever three do not fit; a forced instance is capped at what fits.
TEST(Decode, PlanWeighsCtasAnSmAgainstWaves) {
  using dmattn::cuda::decode_plan;
  const int sms = 132;
  EXPECT_EQ(decode_plan(128, 256, sms, 3).ctas_per_sm, 3);  // B=16, 32k
  EXPECT_EQ(decode_plan(128, 256, sms, 3).splits, 3);       // 384 CTAs on 396 slots
  EXPECT_EQ(decode_plan(512, 64, sms, 3).ctas_per_sm, 2);   // B=64, 8k
  EXPECT_EQ(decode_plan(512, 64, sms, 3).splits, 1);
  EXPECT_EQ(decode_plan(8, 256, sms, 3).ctas_per_sm, 2);    // B=1, 32k
  EXPECT_EQ(decode_plan(512, 1024, sms, 3).ctas_per_sm, 3);  // B=64, 128k
  EXPECT_EQ(decode_plan(128, 256, sms, 2).ctas_per_sm, 2);  // three do not fit this instance
  EXPECT_EQ(decode_plan(128, 256, sms, 2).splits, 2);
  EXPECT_EQ(decode_plan(128, 256, sms, 3, 5).splits, 5);    // asked-for splits are kept
  EXPECT_EQ(decode_plan(8, 64, sms, 1).ctas_per_sm, 1);     // an instance that fits one CTA (d = 256)
  EXPECT_EQ(decode_plan(8, 64, sms, 1, 0, 2).ctas_per_sm, 1);  // ... also where a window asks for two
  EXPECT_EQ(decode_plan(8, 3, sms, 3, 9).splits, 3);        // ... up to the pages
  EXPECT_EQ(decode_plan(512, 64, sms, 3, 0, 3).ctas_per_sm, 3);  // a forced instance (DMATTN_DECODE_CTAS) ...
  EXPECT_EQ(decode_plan(512, 64, sms, 3, 0, 3).splits, 3);       // ... with its own automatic splits
  EXPECT_EQ(decode_plan(128, 256, sms, 3, 0, 2).ctas_per_sm, 2);
  EXPECT_EQ(decode_plan(128, 256, sms, 2, 0, 3).ctas_per_sm, 2);  // three forced where they do not fit: two
  EXPECT_EQ(decode_plan(128, 256, sms, 4, 0, 4).ctas_per_sm, 4);  // four forced where they fit
  EXPECT_EQ(decode_plan(128, 256, sms, 4, 0, 4).splits, 4);       // 512 CTAs on 528 slots
  EXPECT_EQ(decode_plan(128, 256, sms, 3, 0, 4).ctas_per_sm, 3);  // ... and capped where they do not
  // V in MXFP4 fits four (measured: B=16 32k 298 against 303 us at three; B=64 8k 299 against
  // 341 at two; B=1 32k 53.8 against 48.1 at two).
  EXPECT_EQ(decode_plan(128, 256, sms, 4).ctas_per_sm, 4);
  EXPECT_EQ(decode_plan(128, 256, sms, 4).splits, 4);
  EXPECT_EQ(decode_plan(512, 64, sms, 4).ctas_per_sm, 4);
  EXPECT_EQ(decode_plan(512, 64, sms, 4).splits, 1);
  EXPECT_EQ(decode_plan(512, 256, sms, 4).ctas_per_sm, 4);
  EXPECT_EQ(decode_plan(8, 256, sms, 4).ctas_per_sm, 2);
  EXPECT_EQ(decode_plan(8, 1024, sms, 4).ctas_per_sm, 3);  // B=1 128k: four are not considered
}

// The GPU decode's automatic split count (plain C++, so checked here): whole waves of CTAs, no
// split for a batch that already fills the GPU, many for a single long sequence.
TEST(Decode, AutomaticSplitsFillWholeWaves) {
  using dmattn::cuda::decode_auto_splits;
  const int slots = 264;  // an H200: 132 SMs x 2 CTAs
  EXPECT_EQ(decode_auto_splits(128, 256, slots), 2);    // B=16 x Hkv=8, 32k: one wave of 256, not 1.45 of 384
  EXPECT_EQ(decode_auto_splits(512, 1024, slots), 1);   // B=64, 128k: the batch alone fills two waves
  const int s1 = decode_auto_splits(8, 64, slots);      // B=1, 8k: 8 CTA groups
  EXPECT_LE(8 * s1, slots);                             // one wave ...
  EXPECT_GE(8 * s1, slots / 2);                         // ... at least half full
  EXPECT_EQ(decode_auto_splits(8, 1, slots), 1);        // one page: nothing to split
  EXPECT_EQ(decode_auto_splits(8, 0, slots), 1);        // an empty cache
  for (int64_t ctas : {1, 3, 8, 40, 128, 1000})
    for (int pages : {1, 2, 7, 64, 257, 1024}) {
      const int s = decode_auto_splits(ctas, pages, slots);
      EXPECT_GE(s, 1);
      EXPECT_LE(s, pages);
    }
}
