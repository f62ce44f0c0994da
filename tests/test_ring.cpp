// Ring attention with simulated ranks: the schedule, zig-zag load balance, and agreement with
// single-device attention (bit for bit with one rank; to bf16-P rounding, ~1e-4, with LSE merges).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>

#include "dmattn/error.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/ring.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {
struct Result {
  std::vector<float> out, lse;
};

Result single(const QKV& x, const AttentionOptions& o) {
  HostTensor out(DType::f32, x.q.shape());
  Result r{{}, std::vector<float>(size_t(x.q.shape()[1] * x.q.shape()[2]))};
  attention(x.q.view(), x.k.view(), x.v.view(), out.view(), r.lse.data(), o);
  r.out = out.to_floats();
  return r;
}

Result ring(const QKV& x, const AttentionOptions& o, const RingPlan& plan, RingStats* stats = nullptr) {
  HostTensor out(DType::f32, x.q.shape());
  Result r{{}, std::vector<float>(size_t(x.q.shape()[1] * x.q.shape()[2]))};
  ring_attention_simulated(x.q.view(), x.k.view(), x.v.view(), out.view(), r.lse.data(), o, plan, stats);
  r.out = out.to_floats();
  return r;
}
}  // namespace

TEST(Ring, ScheduleVisitsEveryShardOncePerRank) {
  for (Sharding sh : {Sharding::contiguous, Sharding::zigzag})
    for (int R : {1, 2, 3, 4, 8}) {
      const RingPlan plan = RingPlan::make(int64_t(R) * 2 * 128 * 2, R, sh);
      std::set<int64_t> all;
      for (int r = 0; r < R; ++r) {
        std::set<int> seen;
        for (int s = 0; s < R; ++s) seen.insert(plan.kv_source(r, s));
        EXPECT_EQ(int(seen.size()), R);
        EXPECT_EQ(plan.kv_source(r, 0), r);  // a rank starts with its own shard
        for (int64_t c : plan.chunks_of(r)) EXPECT_TRUE(all.insert(c).second);  // chunks partition the sequence
      }
      EXPECT_EQ(int64_t(all.size()) * plan.chunk, plan.n);
    }
  EXPECT_THROW(RingPlan::make(1000, 2, Sharding::zigzag), Error);
}

// The default (rotate, smooth_k with the whole sequence's key mean), smooth_q (each head's query
// mean over the sequence; on every tile and on the high tiles alone) and plain DMA.
TEST(Ring, OneRankIsSingleDeviceAttentionBitForBit) {
  const QKV x = llm_like_qkv({1, 4, 2, 512, 512, 64}, 3);
  Policy sq, sqh;
  sq.smooth_q = SmoothQ::all;
  sqh.smooth_q = SmoothQ::high;
  for (const Policy& pol : {Policy{}, sq, sqh, Policy::plain()}) {
    AttentionOptions o;
    o.causal = true;
    o.policy = pol;
    o.policy.sink_tiles = 1;
    const Result want = single(x, o), got = ring(x, o, RingPlan::make(512, 1, Sharding::contiguous));
    EXPECT_EQ(got.out, want.out) << pol.describe();
    EXPECT_EQ(got.lse, want.lse) << pol.describe();
  }
}

TEST(Ring, MatchesSingleDeviceToBf16Rounding) {
  const QKV x = llm_like_qkv({1, 4, 2, 1024, 1024, 64}, 4);
  for (bool causal : {true, false})
    for (Sharding sh : {Sharding::contiguous, Sharding::zigzag})
      for (int R : {2, 4}) {
        AttentionOptions o;
        o.causal = causal;
        o.policy.diag_tiles = 2;
        o.policy.sink_tiles = 1;
        o.policy.smooth_q = R == 4 ? SmoothQ::all : SmoothQ::high;  // the query mean's all-reduce
        const Result want = single(x, o), got = ring(x, o, RingPlan::make(1024, R, sh));
        const double rel = compare(got.out, want.out).rel_l2;
        std::printf("R=%d %s %s: rel. L2 %.2e vs one device\n", R, sh == Sharding::zigzag ? "zigzag" : "contiguous",
                    causal ? "causal" : "full", rel);
        EXPECT_LT(rel, 1e-3);  // measured 9e-5 .. 2e-4
        EXPECT_GT(rel, 0.0);   // LSE merges do change the bf16 rounding of P
        for (size_t i = 0; i < want.lse.size(); ++i)
          ASSERT_NEAR(got.lse[i], want.lse[i], 1e-5 * (1 + std::fabs(want.lse[i]))) << "row " << i;
      }
}

TEST(Ring, ZigzagBalancesCausalWork) {
  const int R = 4;
  const QKV x = random_qkv({1, 1, 1, 2048, 2048, 32}, 5);
  AttentionOptions o;
  o.causal = true;
  for (Sharding sh : {Sharding::contiguous, Sharding::zigzag}) {
    RingStats st;
    ring(x, o, RingPlan::make(2048, R, sh), &st);
    const auto [lo, hi] = std::minmax_element(st.tile_pairs.begin(), st.tile_pairs.end());
    int64_t total = 0;
    for (int64_t t : st.tile_pairs) total += t;
    EXPECT_EQ(total, 16 * 17 / 2);  // every causal (query tile, key tile) pair exactly once
    std::printf("%s: tile pairs per rank %lld..%lld\n", sh == Sharding::zigzag ? "zigzag" : "contiguous",
                (long long)*lo, (long long)*hi);
    if (sh == Sharding::zigzag)
      EXPECT_EQ(*hi, *lo);  // 2R chunks paired first-with-last: equal work
    else
      EXPECT_GT(*hi, 3 * *lo);
  }
}

TEST(Ring, RefusesWhatNeedsAnAllReduce) {
  const QKV x = random_qkv({1, 2, 2, 256, 256, 64}, 6);
  AttentionOptions o;
  o.policy.low = Format::nvfp4;
  EXPECT_THROW(ring(x, o, RingPlan::make(256, 2, Sharding::contiguous)), Error);
  o = {};
  o.policy.sink_keys = 1;
  EXPECT_THROW(ring(x, o, RingPlan::make(256, 2, Sharding::contiguous)), Error);
  EXPECT_THROW(ring(x, {}, RingPlan::make(512, 2, Sharding::contiguous)), Error);  // plan for another length
}
