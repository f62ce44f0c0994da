// bf16 and fp16 storage types with round-to-nearest-even conversion, usable on host and device.
#pragma once
#include "dmattn/hd.hpp"

namespace dmattn {

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

DMATTN_HD float to_float(float x) { return x; }  // so templates over the three dtypes read alike
DMATTN_HD float to_float(bf16 h) { return hd::float_of(uint32_t(h.bits) << 16); }

DMATTN_HD bf16 to_bf16(float x) {
  uint32_t u = hd::bits_of(x);
  if (hd::is_nan(x)) return bf16{uint16_t((u >> 16) | 0x40)};  // keep a quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);                               // RNE on the dropped 16 bits
  return bf16{uint16_t(u >> 16)};
}

// Rounds x to the nearest bf16 value, returned as float (the value a bf16 MMA operand holds).
DMATTN_HD float round_bf16(float x) { return to_float(to_bf16(x)); }

DMATTN_HD float to_float(fp16 h) {
  const uint32_t s = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t e = (h.bits >> 10) & 0x1F;
  const uint32_t m = h.bits & 0x3FF;
  if (e == 0x1F) return hd::float_of(s | 0x7F800000u | (m << 13));
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float v = hd::ldexp2(float(m), -24);
    return s ? -v : v;
  }
  return hd::float_of(s | ((e + 112) << 23) | (m << 13));
}

DMATTN_HD fp16 to_fp16(float x) {
  const uint32_t u = hd::bits_of(x);
  const uint16_t s = uint16_t((u >> 16) & 0x8000u);
  if (hd::is_nan(x)) return fp16{uint16_t(s | 0x7E00u)};
  const float a = hd::abs_f(x);
  if (a >= 65520.0f) return fp16{uint16_t(s | 0x7C00u)};  // rounds to infinity (IEEE)
  if (a < 6.103515625e-05f) {                              // below 2^-14: subnormal grid 2^-24
    const float q = hd::rint_even(hd::ldexp2(a, 24));
    return fp16{uint16_t(s | uint16_t(q))};  // q == 1024 lands on the smallest normal, as it should
  }
  const uint32_t ua = hd::bits_of(a);
  uint32_t r = ua + 0xFFFu + ((ua >> 13) & 1u);  // RNE on the dropped 13 bits
  r = ((r >> 23) - 112) << 10 | ((r >> 13) & 0x3FF);
  return fp16{uint16_t(s | r)};
}

// from_float<T>: a float rounded into storage type T (nearest-even); to_float reads any back.
template <class T>
DMATTN_HD T from_float(float x);
template <>
DMATTN_HD float from_float<float>(float x) { return x; }
template <>
DMATTN_HD fp16 from_float<fp16>(float x) { return to_fp16(x); }
template <>
DMATTN_HD bf16 from_float<bf16>(float x) { return to_bf16(x); }

}  // namespace dmattn
