// How many splits of the KV pages a GPU decode takes when the caller asks for automatic (0).
// Plain C++ (no CUDA): the CPU tests check it.
#pragma once
#include <algorithm>
#include <cstdint>

namespace dmattn::cuda {

// The count that minimises waves x (pages per split + 1): `ctas` CTA groups (sequence x KV head x row
// chunk) each split `s` ways, `slots` CTAs running at once (two or three an SM), the +1 standing for a CTA's
// fixed cost (q, the merge's share). A partial last wave costs a whole one, so e.g. 128 CTA groups on
// 264 slots take 2 splits (one wave of 256), not 3 (384 CTAs: 1.45 waves, the second mostly idle).
// More splits must win by 3% (each adds partial results to write and merge).
inline int decode_auto_splits(int64_t ctas, int max_pages, int slots) {
  const int np = std::max(1, max_pages);
  slots = std::max(1, slots);
  int best = 1;
  double best_cost = 0.0;
  for (int s = 1; s <= std::min(np, 256); ++s) {
    const double waves = double((ctas * s + slots - 1) / slots), cost = waves * ((np + s - 1) / s + 1);
    if (s == 1 || cost < 0.97 * best_cost) best = s, best_cost = cost;
  }
  return best;
}

// How many CTAs an SM a decode instance runs (two, or three where V is MXFP4 and a CTA has 8 rows:
// fewer stages each) and its splits. Three CTAs move ~4.5% more bytes an SM when the SM is full
// (session 10 run 3: B=16 32k, 361 against 377 us), but a CTA then streams its pages at 1/3 of the
// SM, not 1/2: the time of a plan is waves x (pages per split + 1) x CTAs an SM / that SM rate.
// This picks three at B=16 32k and two at B=64 8k and B=1 32k, where session 10's fixed three ran
// 10% and 5% slower. `splits` > 0: that many (capped at the pages), the instance chosen for them.
// `only` = 2 or 3: that instance (3 only where three fit), with its splits.
struct DecodePlan {
  int ctas_per_sm = 2, splits = 1;
};
inline DecodePlan decode_plan(int64_t ctas, int max_pages, int sms, bool three_fit, int splits = 0, int only = 0) {
  constexpr double kRate3 = 1.045;  // an SM's page rate at three CTAs / at two
  const int np = std::max(1, max_pages);
  sms = std::max(1, sms);
  DecodePlan best;
  double best_time = 0.0;
  const int lo = only == 3 && three_fit ? 3 : 2, hi = only == 2 || !three_fit ? 2 : 3;
  for (int c = lo; c <= hi; ++c) {
    const int slots = c * sms;
    const int s = splits > 0 ? std::min(splits, np) : decode_auto_splits(ctas, max_pages, slots);
    const double waves = double((ctas * s + slots - 1) / slots);
    const double time = waves * ((np + s - 1) / s + 1) * c / (c == 3 ? kRate3 : 1.0);
    if (c == lo || time < best_time) best = {c, s}, best_time = time;
  }
  return best;
}

}  // namespace dmattn::cuda
