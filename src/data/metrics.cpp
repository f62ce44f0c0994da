#include "dmattn/metrics.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "dmattn/error.hpp"

namespace dmattn {

Comparison compare(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size())
    throw Error("cannot compare arrays of " + std::to_string(a.size()) + " and " + std::to_string(ref.size()) + " elements");
  Comparison c;
  double diff2 = 0, ref2 = 0, a2 = 0, dot = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool fa = std::isfinite(a[i]), fr = std::isfinite(ref[i]);
    c.nan_count += !fa;
    c.ref_nonfinite += !fr;
    if (!fa || !fr) continue;
    const double x = a[i], y = ref[i], e = x - y;
    diff2 += e * e;
    ref2 += y * y;
    a2 += x * x;
    dot += x * y;
    c.max_abs = std::max(c.max_abs, std::fabs(e));
  }
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  if (c.nan_count > 0 || c.ref_nonfinite > 0) {  // no norm is meaningful over non-finite values
    c.rel_l2 = c.max_abs = c.cosine = kNaN;
    return c;
  }
  // Relative to a zero reference: 0 when a is zero too, else unbounded.
  c.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : diff2 > 0 ? std::numeric_limits<double>::infinity() : 0.0;
  // The angle to a zero vector is undefined, unless both are zero (equal).
  c.cosine = (a2 > 0 && ref2 > 0) ? dot / std::sqrt(a2 * ref2) : (a2 == 0 && ref2 == 0 ? 1.0 : kNaN);
  return c;
}

}  // namespace dmattn
