// The head dims the CUDA kernels are built for, stated once: every check and every dispatch to a
// kernel's compile-time D goes through here, so a new head dim is one entry in a list plus the
// kernels' own tiling for it.
//  PrefillHeadDims: the prefill kernel and its pre-pass.
//  DecodeHeadDims: the decode kernel and the KV cache in GPU memory (their pages' records).
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "dmattn/error.hpp"

namespace dmattn::cuda {

template <int... Ds>
struct DimList {};
using PrefillHeadDims = DimList<64, 128, 256>;
using DecodeHeadDims = DimList<64, 128, 256>;
// The prefill takes NVFP4 tiles and pv = fp8 up to this head dim, above it MX tiles with pv = bf16
// alone (prefill/smem.cuh says why); the capabilities table states the same bound.
constexpr int kPrefillAllFormsMaxHeadDim = 128;

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

// Throws dmattn::Error, naming `what`, for a head dim the list's kernels are not built for.
template <class List>
void require_head_dim(List list, int64_t d, const char* what) {
  if (!dispatch_dim(list, d, [](auto) {}))
    throw Error(std::string(what) + " supports head dims " + dim_names(list) + " (got " + std::to_string(d) + ")");
}

// f(std::integral_constant<int, D>{}) with D = d, one of the list's.
template <class List, class F>
void with_head_dim(List list, int64_t d, const char* what, F&& f) {
  require_head_dim(list, d, what);
  dispatch_dim(list, d, f);
}

}  // namespace dmattn::cuda
