// The device KV cache's record layout (cuda/kv_record.hpp): the regions tile the record with 16-byte
// aligned ends (a bulk copy's rule), and each chunk swizzle spreads the decode kernel's fragment loads
// (src/cuda/decode/kernel.cu: k_words, k_split_words, the bf16 V ldmatrix) over distinct shared-memory banks. The
// load patterns below are the kernel's address expressions; the GPU decode tests check the values.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "cuda/decode/kv_record.hpp"

using namespace dmattn::cuda;

namespace {

// Whether the accesses of one shared-memory wavefront (byte address, bytes) fall in distinct banks.
bool distinct_banks(const std::vector<std::pair<int, int>>& accesses) {
  std::set<int> banks;
  int words = 0;
  for (auto [addr, bytes] : accesses)
    for (int w = 0; w < bytes / 4; ++w, ++words) banks.insert((addr / 4 + w) % 32);
  return int(banks.size()) == words;
}

}  // namespace

TEST(KvRecord, RegionsTileTheRecordWithAlignedEnds) {
  for (int d : {64, 128})
    for (int vbits : {16, 8, 4}) {
      SCOPED_TRACE("d " + std::to_string(d) + ", V bits " + std::to_string(vbits));
      for (bool e2m1 : {false, true}) {
        EXPECT_EQ(record_k(d, e2m1) + kRecordKeys * record_k_row(d, e2m1), record_k_scales(d));  // K ends at its scales
        EXPECT_EQ(record_k(d, e2m1) % 16, 0);  // the copy starts there
      }
      EXPECT_EQ(record_k(d, false), 0);
      EXPECT_EQ(record_v(d), record_k_scales(d) + kRecordKeys * (d / 32));
      EXPECT_EQ(record_v(d) % 16, 0);
      EXPECT_EQ(record_bytes(d, vbits) % 16, 0);
      const int v_payload = vbits == 16 ? kRecordKeys * d * 2 : d * kRecordKeys * vbits / 8 + d;  // codes (+ scales)
      EXPECT_EQ(record_v_bytes(d, vbits), v_payload);
    }
}

TEST(KvRecord, KFragmentLoadsHitDistinctBanks) {
  for (int d : {64, 128})
    for (bool e2m1 : {false, true}) {
      SCOPED_TRACE("d " + std::to_string(d) + (e2m1 ? ", E2M1" : ", 8-bit codes"));
      const int row = record_k_row(d, e2m1), chunks = row / 16;
      for (int mt = 0; mt < 2; ++mt)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < d / 32; ++c) {
            // One load instruction: lane (g, t) reads key 16 mt + 8 h + g, block c's words of slot t.
            std::vector<std::pair<int, int>> lo, hi;
            for (int lane = 0; lane < 32; ++lane) {
              const int g = lane / 4, t = lane % 4, key = 16 * mt + 8 * h + g;
              const int base = record_k(d, e2m1) + key * row;
              if (e2m1)
                lo.push_back({base + swizzled(chunks, key, c * 16 + 4 * t), 4});
              else  // 8-byte loads: two wavefronts of 16 lanes
                (lane < 16 ? lo : hi).push_back({base + swizzled(chunks, key, c * 32 + 8 * t), 8});
            }
            EXPECT_TRUE(distinct_banks(lo)) << "mt " << mt << " h " << h << " c " << c;
            if (!e2m1) EXPECT_TRUE(distinct_banks(hi)) << "mt " << mt << " h " << h << " c " << c;
          }
    }
}

TEST(KvRecord, Bf16VLdmatrixRowsHitDistinctBanks) {
  for (int d : {64, 128})
    for (int mt = 0; mt < 2; ++mt)
      for (int md = 0; md < d / 16; ++md)
        for (int mi = 0; mi < 4; ++mi) {  // ldmatrix.x4: matrix mi's eight 16-byte rows are one wavefront
          std::vector<std::pair<int, int>> rows;
          for (int r = 0; r < 8; ++r) {
            const int key = 16 * mt + 8 * (mi / 2) + r;
            rows.push_back({record_v(d) + key * 2 * d + swizzled(d / 8, key, (16 * md + 8 * (mi % 2)) * 2), 16});
          }
          EXPECT_TRUE(distinct_banks(rows)) << "d " << d << " mt " << mt << " md " << md << " matrix " << mi;
        }
}

TEST(KvRecord, SwizzlePermutesEachRowsChunks) {
  for (int chunks : {2, 4, 8, 16})
    for (int key = 0; key < kRecordKeys; ++key) {
      std::set<int> seen;
      for (int c = 0; c < chunks; ++c) seen.insert(swizzled(chunks, key, 16 * c) / 16);
      EXPECT_EQ(int(seen.size()), chunks);
      EXPECT_LT(*seen.rbegin(), chunks);
    }
}

// The E4M3 V^T column: lane t of the f16 mma's A fragment (after widening) reads bytes 8t..8t+7, which
// must hold the keys of its P^T fragment: 2t, 2t+1, 8+2t, 9+2t, and the same plus 16.
TEST(KvRecord, VtPositionPutsEachLanesKeysInItsBytes) {
  std::set<int> seen;
  for (int k = 0; k < kRecordKeys; ++k) seen.insert(vt_position(k));
  EXPECT_EQ(int(seen.size()), kRecordKeys);
  EXPECT_EQ(*seen.rbegin(), kRecordKeys - 1);
  for (int t = 0; t < 4; ++t)
    for (int k : {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t, 16 + 2 * t, 17 + 2 * t, 24 + 2 * t, 25 + 2 * t})
      EXPECT_EQ(vt_position(k) / 8, t) << "key " << k;
}
