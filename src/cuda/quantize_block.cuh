// The MX block encoder of the GPU quantize pass (quantize.cu): bit-identical to the CPU codec
// (dmattn/mx_codec.hpp), checked by GpuQuantize. (The prefill kernel used it for an in-kernel Q in
// session 7; that was slower than the pass and was removed, bench/RESULTS.md session 8.)
#pragma once
#include <type_traits>

#include "cuda/fp8.cuh"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {

// Four lanes share one 32-block, eight consecutive elements each.
constexpr int kPerLane = 8;

// The storage code of a scaled value (the codec's encode_elem: FP8 by the hardware conversion,
// E2M1 by its midpoint count, FP6 by the generic rounding), and the FP8 byte holding a code's value
// (E5M2 for E5M2, E4M3 for every other element). Compile-time element types keep the per-element
// work to a few instructions: the runtime spec of the generic codec cost ~5x the memory time.
template <Elem E>
__device__ __forceinline__ uint8_t elem_code(float s) {
  if constexpr (E == Elem::e4m3 || E == Elem::e5m2)
    return fp8_encode<E == Elem::e5m2>(s);
  else if constexpr (E == Elem::e2m1)
    return encode_e2m1(s);
  else
    return encode_elem(elem_spec(E), s);
}

template <Elem E>
__device__ __forceinline__ uint8_t fp8_byte(uint8_t code) {
  if constexpr (E == Elem::e4m3 || E == Elem::e5m2) {
    return code;
  } else if constexpr (E == Elem::e2m1) {
    // E2M1 magnitudes 0, 0.5, then 2^((m>>1)-1) * (1 + (m&1)/2): E4M3 exponent field (m>>1)+6,
    // mantissa (m&1)<<2.
    const int m = code & 7;
    const int mag = m == 0 ? 0 : m == 1 ? 0x30 : (((m >> 1) + 6) << 3) | ((m & 1) << 2);
    return uint8_t(((code & 8) << 4) | mag);
  } else {
    return fp8_encode<false>(decode_elem(E, code));
  }
}

// One lane's share (kPerLane elements) of a 32-block held by 4 consecutive lanes, whose amax and
// non-finite flag the caller has combined: the block's E8M0 scale (returned) and the element codes;
// with fp8_bytes, the codes as FP8 bytes, and with fold as well, shifted to the largest scale of the
// row's row_lanes lanes where every block of the row stays exact (then all its blocks return that
// scale). Every lane of the warp must call it (shuffles).
template <Elem E>
__device__ __forceinline__ uint8_t encode_lane(ScaleRule rule, const float (&v)[kPerLane], float amax, bool bad,
                                               bool fp8_bytes, bool fold, int row_lanes, uint8_t (&codes)[kPerLane]) {
  constexpr bool kE5M2 = E == Elem::e5m2;
  uint8_t sc = bad ? kE8M0NaN : choose_e8m0(amax, E, rule);
  // 2^-X as one factor (2^-127 is subnormal but exact): a product by a power of two rounds once,
  // exactly like the codec's ldexp.
  const float inv = hd::ldexp2(1.0f, 127 - int(sc));
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    codes[i] = sc == kE8M0NaN ? uint8_t(0) : elem_code<E>(v[i] * inv);
    if (fp8_bytes) codes[i] = fp8_byte<E>(codes[i]);
  }
  if (fold) {  // uniform across the grid: every lane takes part in the shuffles
    int smax = sc;
    for (int s = 4; s < row_lanes; s <<= 1) smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, s));
    const int k = int(sc) - smax;  // <= 0: this block's values shift down by 2^k
    // FP8 values are >= 2^-16 in magnitude, so a shift below 2^-24 cannot stay representable.
    const float shift = k >= -24 ? hd::ldexp2(1.0f, k) : 0.0f;
    uint8_t folded[kPerLane];
    bool exact = !bad && smax != kE8M0NaN;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float value = fp8_decode<kE5M2>(codes[i]);
      const float shifted = value * shift;
      folded[i] = fp8_encode<kE5M2>(shifted);
      exact &= value == 0.0f || (k >= -24 && fp8_decode<kE5M2>(folded[i]) == shifted);
    }
    for (int s = 1; s < row_lanes; s <<= 1) exact &= __shfl_xor_sync(0xffffffffu, int(exact), s) != 0;
    if (exact) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) codes[i] = folded[i];
      sc = uint8_t(smax);
    }
  }
  return sc;
}

// A lane's eight code bytes as one 8-byte word (little-endian: codes[0] first).
__device__ __forceinline__ uint2 pack8(const uint8_t (&codes)[kPerLane]) {
  uint2 w;
  w.x = uint32_t(codes[0]) | uint32_t(codes[1]) << 8 | uint32_t(codes[2]) << 16 | uint32_t(codes[3]) << 24;
  w.y = uint32_t(codes[4]) | uint32_t(codes[5]) << 8 | uint32_t(codes[6]) << 16 | uint32_t(codes[7]) << 24;
  return w;
}

// The block's amax and whether it holds NaN/Inf, combined over its 4 lanes (every lane calls it).
__device__ __forceinline__ void block_stats(const float (&v)[kPerLane], float& amax, bool& bad) {
  amax = 0.0f;
  bad = false;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    bad |= !hd::is_finite(v[i]);
    amax = fmaxf(amax, hd::abs_f(v[i]));
  }
#pragma unroll
  for (int s = 1; s < 4; s <<= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
    bad |= __shfl_xor_sync(0xffffffffu, int(bad), s) != 0;
  }
}

// Whether every block of the row (its row_lanes lanes, 4 a block) has the scale code sc (every lane
// of the warp calls it).
__device__ __forceinline__ bool row_scales_equal(int sc, int row_lanes) {
  int smin = sc, smax = sc;
  for (int s = 4; s < row_lanes; s <<= 1) {
    smin = min(smin, __shfl_xor_sync(0xffffffffu, smin, s));
    smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, s));
  }
  return smin == smax;
}

template <class F>
__device__ __forceinline__ void with_elem(Elem e, F&& f) {
  switch (e) {
    case Elem::e4m3: f(std::integral_constant<Elem, Elem::e4m3>{}); break;
    case Elem::e5m2: f(std::integral_constant<Elem, Elem::e5m2>{}); break;
    case Elem::e3m2: f(std::integral_constant<Elem, Elem::e3m2>{}); break;
    case Elem::e2m3: f(std::integral_constant<Elem, Elem::e2m3>{}); break;
    case Elem::e2m1: f(std::integral_constant<Elem, Elem::e2m1>{}); break;
  }
}

}  // namespace dmattn::cuda
