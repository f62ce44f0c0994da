// The rotation of include/dmattn/rotation.hpp on a row held by one warp: lane l holds channels
// E l .. E l + E - 1 of a row of 32 E channels, one rotation block (d 64 and 128). The signs, then
// the butterfly stage by stage: stages h < E between this lane's registers, the others between
// lanes h / E apart, the lower channel of a pair taking a + b and the upper a - b (as the fma
// r * -1 + other, exact), so every value is rotate_row's bit for bit.
#pragma once
#include "dmattn/rotation.hpp"

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

}  // namespace dmattn::cuda
