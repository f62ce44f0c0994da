// How an append's new key rows are shared among warps: each warp takes a run of consecutive tokens of
// one (batch entry, head). One row a warp where the append is small (a decode step); for a prompt up to
// 32, keeping at least kRowWarps warps: a warp's rows share their page's bookkeeping and the key mean,
// loaded once, and each row's load is in flight while the row before it is encoded (a warp a row
// waited on a chain of dependent loads for every row). Host and device: the host sizes the launch with
// row_runs, the kernel maps its warps with row_run, and the CPU tests check that the runs cover every
// row once.
#pragma once
#include <cstdint>

#include "dmattn/hd.hpp"

namespace dmattn::cuda::kv {

constexpr int64_t kRowWarps = 32768;

// Rows a run, for an append of `rows` rows in all (S x Hkv x n): a power of two, 1 to 32.
DMATTN_HD int rows_per_warp(int64_t rows) {
  int r = 1;
  while (r < 32 && rows >= 2 * r * kRowWarps) r *= 2;  // rows / (2 r) >= kRowWarps, without a division
  return r;
}

// The runs (warps) of an append of n tokens to S sequences of Hkv heads.
DMATTN_HD int64_t row_runs(int64_t S, int Hkv, int64_t n) {
  const int r = rows_per_warp(S * Hkv * n);
  return S * Hkv * ((n + r - 1) / r);
}

// Run w (< row_runs): tokens t0 .. t1 - 1 of head h of batch entry i; runs of one entry and head are
// consecutive warps.
struct RowRun {
  int i, h, t0, t1;
};
DMATTN_HD RowRun row_run(int64_t w, int64_t S, int Hkv, int n) {
  const int r = rows_per_warp(S * Hkv * n), nr = (n + r - 1) / r;
  const int run = int(w % nr);
  return RowRun{int(w / nr / Hkv), int(w / nr % Hkv), run * r, run * r + r < n ? run * r + r : n};
}

}  // namespace dmattn::cuda::kv
