// How many splits of the KV pages a GPU decode takes when the caller asks for automatic (0).
// Plain C++ (no CUDA): the CPU tests check it.
#pragma once
#include <algorithm>
#include <cstdint>

namespace dmattn::cuda {

// The count that minimises waves x (pages per split + 1): `ctas` CTA groups (sequence x KV head x row
// chunk) each split `s` ways, `slots` CTAs running at once (two to four an SM), the +1 standing for a CTA's
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

// How many CTAs an SM a decode instance runs (two; three or four where the instance fits them: fewer
// stages each, see decode/params.cuh's max_ctas) and its splits. More CTAs move more bytes an SM when the SM is
// full, but a CTA then streams its pages at 1/c of the SM: the time of a plan is
// waves x (pages per split + 1) x c / that SM's rate at c. Measured (measured: V in MXFP4,
// forced instances, us): B=16 32k 323 / 303 / 298 at two / three / four; B=64 8k 341 / 361 / 299;
// B=64 32k 1221 / 1128 / 1105; B=1 32k 48.1 / 50.6 / 53.8 (V in MXFP8: B=16 32k 303 / 284, B=64 8k
// 319 / 340). Four CTAs only where the CTA groups alone fill half the SMs: at B=1 the model put four 2%
// behind two, measured 12%. `splits` > 0: that many (capped at the pages), the instance chosen for them.
// `only` = 2, 3 or 4: that instance (capped at max_ctas), with its splits. An instance that fits one CTA
// an SM (max_ctas 1: d = 256 with MXFP8 or bf16 V) runs at one.
struct DecodePlan {
  int ctas_per_sm = 2, splits = 1;
};
inline DecodePlan decode_plan(int64_t ctas, int max_pages, int sms, int max_ctas, int splits = 0, int only = 0) {
  // An SM's page rate at c CTAs over its rate at two (full-SM runs measure ~1.08 for three; 1.045 keeps
  // two at B=64 8k, where three's extra splits cost 6% in the measurement).
  constexpr double kRate[5] = {0.0, 1.0, 1.0, 1.045, 1.09};
  const int np = std::max(1, max_pages), top = std::clamp(max_ctas, 1, 4);
  sms = std::max(1, sms);
  DecodePlan best;
  double best_time = 0.0;
  const int most = 2 * ctas >= sms ? top : std::min(top, 3);  // four only where the groups fill half the SMs
  const int lo = only > 0 ? std::clamp(only, std::min(2, top), top) : std::min(2, top), hi = only > 0 ? lo : most;
  for (int c = lo; c <= hi; ++c) {
    const int slots = c * sms;
    const int s = splits > 0 ? std::min(splits, np) : decode_auto_splits(ctas, max_pages, slots);
    const double waves = double((ctas * s + slots - 1) / slots);
    const double time = waves * ((np + s - 1) / s + 1) * c / kRate[c];
    if (c == lo || time < best_time) best = {c, s}, best_time = time;
  }
  return best;
}

}  // namespace dmattn::cuda
