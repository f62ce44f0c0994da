#pragma once
#include <cstdint>
#include <vector>

namespace dmattn {

struct Comparison {
  double rel_l2 = 0;   // ||a - b|| / ||b|| (b is the reference)
  double max_abs = 0;  // max |a - b|
  double cosine = 0;   // <a, b> / (|a| |b|)
  int64_t nan_count = 0;  // NaN or Inf elements of a
};

Comparison compare(const std::vector<float>& a, const std::vector<float>& ref);

}  // namespace dmattn
