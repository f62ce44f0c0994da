// Packed variable-length batches (varlen_attention): each sequence of the packed tensors must come
// out exactly as attention() computes that sequence alone (outputs and LSE bit for bit, the LSE in
// flash-attn's [Hq, total_q] layout), for causal and windowed masks, GQA and a policy with sink and
// diagonal tiles (the tiles count from each sequence's own first token); bad offsets are errors; and
// the tables with which the CUDA prefill takes a packed batch in one call.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/prefill/packing.hpp"
#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

std::vector<int32_t> offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

// A packed [total, H, d] array as the [1, H, total, d] view varlen_attention takes.
TensorView packed(HostTensor& t) {
  TensorView v = t.view();  // [1, total, H, d] contiguous
  std::swap(v.shape[1], v.shape[2]);
  std::swap(v.stride[1], v.stride[2]);
  return v;
}

}  // namespace

TEST(Varlen, EachSequenceAsAttentionAlone) {
  const std::vector<int32_t> lq = {5, 130, 0, 300, 1}, lk = {5, 200, 7, 300, 129};
  const std::vector<int32_t> cq = offsets(lq), ck = offsets(lk);
  const int64_t Hq = 4, Hkv = 2, d = 64, tq = cq.back(), tk = ck.back();
  const QKV x = random_qkv({1, Hq, Hkv, tq, tk, d}, 11);  // only its values are used, as packed rows
  HostTensor q = HostTensor::from_floats(x.q.to_floats(), {1, tq, Hq, d});
  HostTensor k = HostTensor::from_floats(x.k.to_floats(), {1, tk, Hkv, d});
  HostTensor v = HostTensor::from_floats(x.v.to_floats(), {1, tk, Hkv, d});
  Policy sinks = Policy::tiles(Format::mxfp8_e4m3, Format::mxfp4, 1, 1);
  sinks.sink_keys = 2;
  struct Case {
    Policy pol;
    int64_t left;
  };
  for (const Case& c : {Case{Policy{}, -1}, Case{sinks, -1}, Case{Policy{}, 100}}) {
    AttentionOptions o;
    o.causal = true;
    o.policy = c.pol;
    o.window_left = c.left;
    HostTensor out(DType::f32, {1, tq, Hq, d});
    std::vector<float> lse(size_t(Hq * tq), -1.0f);
    varlen_attention(packed(q), packed(k), packed(v), packed(out), lse.data(), cq, ck, o);
    const std::vector<float> got = out.to_floats();
    for (size_t i = 0; i < lq.size(); ++i) {
      if (lq[i] == 0) continue;
      // The sequence alone, copied out of the packed arrays into contiguous [1, H, n, d] tensors.
      const HostTensor qi = HostTensor::copy_of(slice_tokens(packed(q), cq[i], lq[i]));
      const HostTensor ki = HostTensor::copy_of(slice_tokens(packed(k), ck[i], lk[i]));
      const HostTensor vi = HostTensor::copy_of(slice_tokens(packed(v), ck[i], lk[i]));
      HostTensor oi(DType::f32, qi.shape());
      std::vector<float> li(size_t(Hq * lq[i]));
      attention(qi.view(), ki.view(), vi.view(), oi.view(), li.data(), o);
      const std::vector<float> want = oi.to_floats();
      const std::string what = "sequence " + std::to_string(i) + " left " + std::to_string(c.left);
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t r = 0; r < lq[i]; ++r) {
          EXPECT_EQ(std::memcmp(&got[size_t(((cq[i] + r) * Hq + h) * d)], &want[size_t((h * lq[i] + r) * d)], d * 4), 0)
              << what << " head " << h << " row " << r;
          EXPECT_EQ(lse[size_t(h * tq + cq[i] + r)], li[size_t(h * lq[i] + r)]) << what << " head " << h << " row " << r;
        }
    }
  }
}

TEST(Varlen, RejectsBadOffsets) {
  const QKV x = random_qkv({1, 2, 2, 10, 10, 64}, 3);
  HostTensor out(DType::f32, x.q.shape());
  AttentionOptions o;
  auto run = [&](const std::vector<int32_t>& cq, const std::vector<int32_t>& ck, const AttentionOptions& opt) {
    varlen_attention(x.q.view(), x.k.view(), x.v.view(), out.view(), nullptr, cq, ck, opt);
  };
  EXPECT_NO_THROW(run({0, 4, 10}, {0, 4, 10}, o));
  EXPECT_THROW(run({0, 10}, {0, 4, 10}, o), Error);     // lengths differ
  EXPECT_THROW(run({1, 10}, {0, 10}, o), Error);        // not from 0
  EXPECT_THROW(run({0, 9}, {0, 10}, o), Error);         // not to total
  EXPECT_THROW(run({0, 6, 4, 10}, {0, 3, 6, 10}, o), Error);  // decreasing
  EXPECT_THROW(run({0, 4, 10}, {0, 0, 10}, o), Error);  // queries without keys
  AttentionOptions off = o;
  off.q_offset = 0;
  EXPECT_THROW(run({0, 10}, {0, 10}, off), Error);
}

// The CUDA prefill's tables for one call over packed sequences (built on the host, so tested here):
// each sequence's keys take whole 128-key tiles of their own, in order, the slot map and its inverse
// agree, and the work list holds every query tile of every sequence once, longest first.
TEST(Varlen, PackingGivesEachSequenceItsOwnTilesAndEveryQueryTileOnce) {
  const std::vector<int32_t> lq = {5, 130, 0, 300, 1, 200}, lk = {5, 200, 7, 300, 129, 100};
  const std::vector<int32_t> cq = offsets(lq), ck = offsets(lk);
  for (int64_t left : {int64_t(-1), int64_t(150)}) {
    const Mask mask{0, true, left, -1};
    const cuda::Packing pk(cq, ck, mask);
    const auto at = [&](size_t base, int64_t i) { return pk.words[base + size_t(i)]; };
    int64_t tiles = 0;
    for (int32_t n : lk) tiles += (n + kTile - 1) / kTile;
    ASSERT_EQ(pk.ldv, tiles * kTile);
    ASSERT_EQ(pk.nseq, int(lq.size()));
    std::vector<int> seen(size_t(pk.ldv), 0);
    int32_t tile0 = 0;
    for (size_t i = 0; i < lk.size(); ++i) {
      cuda::SeqSpan s;
      std::memcpy(&s, &pk.words[pk.seqs + i * sizeof(s) / 4], sizeof(s));
      EXPECT_EQ(s.q0, cq[i]);
      EXPECT_EQ(s.nq, lq[i]);
      EXPECT_EQ(s.k0, ck[i]);
      EXPECT_EQ(s.nk, lk[i]);
      EXPECT_EQ(s.tile0, tile0) << "sequence " << i;
      for (int32_t j = 0; j < lk[i]; ++j) {
        const int32_t slot = at(pk.key_slot, ck[i] + j);
        EXPECT_EQ(slot, tile0 * kTile + j);
        EXPECT_EQ(at(pk.key_seq, ck[i] + j), int32_t(i));
        EXPECT_EQ(at(pk.slot_key, slot), ck[i] + j);
        ++seen[size_t(slot)];
      }
      for (int32_t r = 0; r < lq[i]; ++r) EXPECT_EQ(at(pk.query_seq, cq[i] + r), int32_t(i));
      tile0 += (lk[i] + kTile - 1) / kTile;
    }
    for (int64_t slot = 0; slot < pk.ldv; ++slot)  // padding slots name no key
      if (!seen[size_t(slot)]) EXPECT_EQ(at(pk.slot_key, slot), -1) << "slot " << slot;
    // Work: each (sequence, query block) the sequence's rows touch, once, with non-increasing key tiles.
    std::vector<std::pair<int32_t, int32_t>> want, got;
    for (size_t i = 0; i < lq.size(); ++i) {
      if (lq[i] == 0) continue;
      const int64_t pos0 = lk[i] - lq[i];
      for (int64_t b = hd::floor_div(pos0, kTile); b <= hd::floor_div(pos0 + lq[i] - 1, kTile); ++b)
        want.push_back({int32_t(i), int32_t(b)});
    }
    int64_t last = INT64_MAX;
    for (int64_t n = 0; n < pk.works; ++n) {
      const int32_t seq = at(pk.work, 2 * n), block = at(pk.work, 2 * n + 1);
      got.push_back({seq, block});
      Mask m = mask;
      m.nk = lk[size_t(seq)];
      const int64_t cost = (m.key_end(int64_t(block) * kTile + kTile - 1) + kTile - 1) / kTile - m.key_begin(int64_t(block) * kTile) / kTile;
      EXPECT_LE(cost, last) << "work item " << n;
      last = cost;
    }
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want) << "left " << left;
  }
}
