// The rotation of include/dmattn/rotation.hpp on a row held by one warp: lane l holds channels
// E l .. E l + E - 1 of a row of 32 E channels, one rotation block (d 64, 128 and 256). The signs, then
// the butterfly stage by stage: stages h < E between this lane's registers, the others between
// lanes h / E apart, the lower channel of a pair taking a + b and the upper a - b (as the fma
// r * -1 + other, exact), so every value is rotate_row's bit for bit.
//
// load_lane: a lane's E channels of such a row, loaded.
#pragma once
#include <cstdint>
#include <type_traits>

#include "dmattn/numeric.hpp"
#include "dmattn/rotation.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn::cuda {

template <int E>
__device__ __forceinline__ void rotate_lanes(float (&r)[E]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int e = 0; e < E; ++e) r[e] *= rotation_sign(lane * E + e);
#pragma unroll
  for (int h = 1; h < E; h *= 2)  // partners in this lane's registers
#pragma unroll
    for (int e = 0; e < E; ++e)
      if (!(e & h)) {
        const float a = r[e], c = r[e + h];
        r[e] = a + c;
        r[e + h] = a - c;
      }
#pragma unroll
  for (int l = 1; l < 32; l *= 2) {  // partners in other lanes (channel distance l E)
    const float sign = lane & l ? -1.0f : 1.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) r[e] = fmaf(r[e], sign, __shfl_xor_sync(0xffffffffu, r[e], l));
  }
}

// This lane's E channels of a row (p: its first, channel E lane; unit stride) as fp32: one vector load
// where `vec` (16-bit values, p aligned to E of them), else E loads.
template <int E, class T>
__device__ __forceinline__ void load_lane(const T* p, bool vec, float (&r)[E]) {
  if constexpr (sizeof(T) == 2 && E >= 2 && E <= 8) {
    if (vec) {
      using V = std::conditional_t<E == 2, uint32_t, std::conditional_t<E == 4, uint2, uint4>>;
      const V w = *reinterpret_cast<const V*>(p);
      const uint16_t* h16 = reinterpret_cast<const uint16_t*>(&w);
#pragma unroll
      for (int e = 0; e < E; ++e) r[e] = to_float(T{h16[e]});
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) r[e] = to_float(p[e]);
}

// Whether every row of a [B, H, N, d] view can take load_lane's vector path for E channels a lane.
inline bool vector_rows(const TensorView& v, int E) {
  if (dtype_size(v.dtype) != 2 || v.stride[3] != 1) return false;
  if (reinterpret_cast<uintptr_t>(v.data) % uintptr_t(2 * E) != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (v.stride[i] % E != 0) return false;
  return true;
}

}  // namespace dmattn::cuda
