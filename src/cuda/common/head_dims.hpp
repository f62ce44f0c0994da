// The head dims the CUDA kernels are built for, stated once (HeadDims): every check and every
// dispatch to a kernel's compile-time D goes through here, so a new head dim is one entry in the
// list plus the kernels' own tiling for it.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "dmattn/error.hpp"

namespace dmattn::cuda {

template <int... Ds>
struct DimList {};
using HeadDims = DimList<64, 128>;

// Calls f(std::integral_constant<int, D>{}) for the listed D equal to d; false if none is.
template <class F, int... Ds>
bool dispatch_dim(DimList<Ds...>, int64_t d, F&& f) {
  return ((d == Ds ? (f(std::integral_constant<int, Ds>{}), true) : false) || ...);
}

template <int... Ds>
std::string dim_names(DimList<Ds...>) {
  std::string s;
  ((s += (s.empty() ? "" : ", ") + std::to_string(Ds)), ...);
  return s;
}

template <int... Ds>
std::vector<int64_t> dim_vector(DimList<Ds...>) {
  return {Ds...};
}

inline bool head_dim_built(int64_t d) { return dispatch_dim(HeadDims{}, d, [](auto) {}); }

// Throws dmattn::Error, naming `what`, for a head dim the kernels are not built for.
inline void require_head_dim(int64_t d, const char* what) {
  if (!head_dim_built(d))
    throw Error(std::string(what) + " supports head dims " + dim_names(HeadDims{}) + " (got " + std::to_string(d) + ")");
}

// f(std::integral_constant<int, D>{}) with D = d (require_head_dim first).
template <class F>
void with_head_dim(int64_t d, const char* what, F&& f) {
  require_head_dim(d, what);
  dispatch_dim(HeadDims{}, d, f);
}

}  // namespace dmattn::cuda
