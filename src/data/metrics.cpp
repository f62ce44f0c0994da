#include "dmattn/metrics.hpp"

#include <algorithm>
#include <cmath>

#include "dmattn/error.hpp"

namespace dmattn {

Comparison compare(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size())
    throw Error("cannot compare arrays of " + std::to_string(a.size()) + " and " + std::to_string(ref.size()) + " elements");
  Comparison c;
  double diff2 = 0, ref2 = 0, a2 = 0, dot = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) {
      ++c.nan_count;
      continue;
    }
    const double x = a[i], y = ref[i], e = x - y;
    diff2 += e * e;
    ref2 += y * y;
    a2 += x * x;
    dot += x * y;
    c.max_abs = std::max(c.max_abs, std::fabs(e));
  }
  c.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  c.cosine = (a2 > 0 && ref2 > 0) ? dot / std::sqrt(a2 * ref2) : (a2 == ref2 ? 1.0 : 0.0);
  if (c.nan_count > 0) c.rel_l2 = std::nan("");
  return c;
}

}  // namespace dmattn
