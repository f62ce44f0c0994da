// FP8 conversions in hardware (sm_89+): RNE with saturation to the largest finite value, which is
// the codec's encode_elem for E4M3/E5M2 (mx_codec.hpp), and the exact widening back to float.
#pragma once
#include <cstdint>

#include "cuda/ptx/e2m1_bytes.hpp"  // prmt and the E2M1 widenings (host-testable)

namespace dmattn::cuda {

// Two values in one conversion: lo in the low byte.
template <bool kE5M2>
__device__ __forceinline__ uint16_t fp8x2_encode(float lo, float hi) {
  uint16_t r;
  if constexpr (kE5M2)
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
template <bool kE5M2>
__device__ __forceinline__ uint8_t fp8_encode(float x) { return uint8_t(fp8x2_encode<kE5M2>(x, 0.0f) & 0xFF); }

// Two values rounded to bf16 (RNE) in one conversion, returned as floats: round_bf16's values for
// every input but NaN, which stays a NaN without its payload.
__device__ __forceinline__ void round_bf16x2(float& lo, float& hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  lo = __uint_as_float(r << 16);
  hi = __uint_as_float(r & 0xFFFF0000u);
}

// Every E4M3 and E5M2 value is an fp16 value, so widening to f16 is exact, and so is narrowing an
// f16 that holds such a value back (the decode kernel transposes FP8 pairs through f16 this way).
// Two FP8 bytes (low 16 bits of x, low byte first) -> two f16 (low half first), and back.
template <bool kE5M2>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t x) {
  uint32_t r;
  if constexpr (kE5M2)
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(uint16_t(x)));
  else
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(uint16_t(x)));
  return r;
}
// The high 16 bits of x by an unpack, which ptxas folds into the consumer's half select (F2FP .H1):
// x >> 16 cost a shift instruction each.
__device__ __forceinline__ uint32_t hi16(uint32_t x) {
  uint16_t h;
  asm("mov.b32 {_, %0}, %1;" : "=h"(h) : "r"(x));
  return h;
}
template <bool kE5M2>
__device__ __forceinline__ uint32_t f16x2_to_fp8x2(uint32_t x) {
  uint16_t r;
  if constexpr (kE5M2)
    asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;" : "=h"(r) : "r"(x));
  else
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(x));
  return r;
}
template <bool kE5M2>
__device__ __forceinline__ float fp8_decode(uint8_t b) {
  const uint32_t h2 = fp8x2_to_f16x2<kE5M2>(b);
  float f;
  asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo;}" : "=f"(f) : "r"(h2));
  return f;
}

}  // namespace dmattn::cuda
