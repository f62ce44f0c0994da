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

}  // namespace dmattn::cuda
