#pragma once
#include <cstdint>
#include <vector>

namespace dmattn {

// Error of a against a reference. Any NaN/Inf in either makes rel_l2, max_abs and cosine NaN (the
// counts say where); a zero reference gives rel_l2 0 (a is zero too) or +inf.
struct Comparison {
  double rel_l2 = 0;          // ||a - b|| / ||b|| (b is the reference)
  double max_abs = 0;         // max |a - b|
  double cosine = 0;          // <a, b> / (|a| |b|); NaN when exactly one is zero
  int64_t nan_count = 0;      // NaN or Inf elements of a
  int64_t ref_nonfinite = 0;  // NaN or Inf elements of the reference
};

Comparison compare(const std::vector<float>& a, const std::vector<float>& ref);

}  // namespace dmattn
