// How the device KV cache's appends share new key rows among warps (cuda/kv/row_runs.hpp): the runs
// of the launch's warps cover every (batch entry, head, token) of an append exactly once, in
// consecutive tokens, with one row a warp for a decode step and several for a prompt. The GPU tests
// check the rows' bytes against the host cache.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/kv/row_runs.hpp"

using namespace dmattn::cuda::kv;

TEST(KvRowRuns, CoverEveryRowOnce) {
  struct Case {
    int64_t S;
    int Hkv, n;
  };
  const std::vector<Case> cases = {{1, 8, 1},    {16, 8, 1},    {3, 2, 700},   {4, 8, 2100},  {4, 8, 8192},
                                   {16, 8, 4097}, {1, 1, 65537}, {2, 8, 32768}, {5, 3, 30001}, {64, 8, 1}};
  for (const Case& c : cases) {
    SCOPED_TRACE("S " + std::to_string(c.S) + ", Hkv " + std::to_string(c.Hkv) + ", n " + std::to_string(c.n));
    std::vector<int> seen(size_t(c.S * c.Hkv * c.n), 0);
    const int64_t runs = row_runs(c.S, c.Hkv, c.n);
    const int r = rows_per_warp(c.S * c.Hkv * c.n);
    for (int64_t w = 0; w < runs; ++w) {
      const RowRun run = row_run(w, c.S, c.Hkv, c.n);
      ASSERT_GE(run.i, 0);
      ASSERT_LT(run.i, c.S);
      ASSERT_GE(run.h, 0);
      ASSERT_LT(run.h, c.Hkv);
      ASSERT_GE(run.t0, 0);
      ASSERT_LT(run.t0, run.t1);  // never an empty run
      ASSERT_LE(run.t1, c.n);
      ASSERT_LE(run.t1 - run.t0, r);
      for (int t = run.t0; t < run.t1; ++t) ++seen[size_t((run.i * c.Hkv + run.h) * c.n + t)];
    }
    for (size_t k = 0; k < seen.size(); ++k) ASSERT_EQ(seen[k], 1) << "row " << k;
  }
}

TEST(KvRowRuns, OneRowAWarpForSmallAppendsSeveralForPrompts) {
  EXPECT_EQ(rows_per_warp(16 * 8), 1);       // a decode step of 16 sequences
  EXPECT_EQ(rows_per_warp(65535), 1);        // below two rows for each of kRowWarps warps
  EXPECT_EQ(rows_per_warp(65536), 2);
  EXPECT_EQ(rows_per_warp(4 * 8 * 8192), 8);  // the GPU test's large prompt
  EXPECT_EQ(rows_per_warp(16 * 8 * 32768), 32);
  EXPECT_EQ(rows_per_warp(int64_t(1) << 40), 32);  // never more than 32
  for (int64_t rows : {int64_t(65536), int64_t(1) << 20, int64_t(16) * 8 * 32768})
    EXPECT_GE(rows / rows_per_warp(rows), kRowWarps) << rows;  // the launch keeps its warps
}
