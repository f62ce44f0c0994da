// The MX codec (OCP Microscaling Formats v1.0): element formats, E8M0 scales, NVFP4's E4M3 block
// scales. One header for host and device, so every backend sees the same codes.
#pragma once
#include "dmattn/hd.hpp"

namespace dmattn {

// Element formats. The numeric value of each enumerator is irrelevant; use elem_spec().
enum class Elem : uint8_t { e4m3, e5m2, e3m2, e2m3, e2m1 };

// How a block's shared exponent X is chosen from the block's absolute maximum.
//  ocp : X = floor(log2 amax) - emax_elem (the spec); elements above max finite saturate.
//  ceil: the smallest X with amax / 2^X <= max finite; nothing saturates.
enum class ScaleRule : uint8_t { ocp, ceil };

struct ElemSpec {
  int ebits, mbits, bias;
  int emax;        // exponent of the largest finite value (emax_elem in the spec)
  float max;       // largest finite value
  uint8_t max_code;  // code of +max
  bool has_nan;    // E4M3: S.1111.111; E5M2: S.11111.{01,10,11}
  bool has_inf;    // E5M2: S.11111.00
};

DMATTN_HD ElemSpec elem_spec(Elem e) {
  switch (e) {
    case Elem::e4m3: return {4, 3, 7, 8, 448.0f, 0x7E, true, false};
    case Elem::e5m2: return {5, 2, 15, 15, 57344.0f, 0x7B, true, true};
    case Elem::e3m2: return {3, 2, 3, 4, 28.0f, 0x1F, false, false};
    case Elem::e2m3: return {2, 3, 1, 2, 7.5f, 0x1F, false, false};
    case Elem::e2m1: default: return {2, 1, 1, 2, 6.0f, 0x7, false, false};
  }
}

DMATTN_HD int elem_bits(Elem e) {
  const ElemSpec s = elem_spec(e);
  return 1 + s.ebits + s.mbits;
}

// Value of an element code (the low elem_bits of `code`). NaN codes decode to NaN.
DMATTN_HD float decode_elem(Elem e, uint8_t code) {
  const ElemSpec s = elem_spec(e);
  const int nb = s.ebits + s.mbits;
  const bool neg = (code >> nb) & 1;
  const int ef = (code >> s.mbits) & ((1 << s.ebits) - 1);
  const int mf = code & ((1 << s.mbits) - 1);
  const int emask = (1 << s.ebits) - 1;
  float v;
  if (s.has_inf && ef == emask) {
    v = mf == 0 ? hd::float_of(0x7F800000u) : hd::float_of(0x7FC00000u);
  } else if (s.has_nan && !s.has_inf && ef == emask && mf == (1 << s.mbits) - 1) {
    v = hd::float_of(0x7FC00000u);
  } else if (ef == 0) {
    v = hd::ldexp2(float(mf), 1 - s.bias - s.mbits);
  } else {
    v = hd::ldexp2(float((1 << s.mbits) + mf), ef - s.bias - s.mbits);
  }
  return neg ? -v : v;
}

// Nearest element code to x, ties to even, saturating to +-max (infinities too). NaN encodes to
// the format's NaN where it has one and to +0 otherwise (MX carries NaN in the scale instead).
// E2M1 has eight magnitudes, so round-to-nearest-even is a count of the midpoints below |x|:
// strict at a midpoint whose lower neighbour has the even code, inclusive where the upper one has.
DMATTN_HD uint8_t encode_e2m1(float x) {
  if (hd::is_nan(x)) return 0;
  const float a = hd::abs_f(x);
  const int c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return uint8_t(((hd::bits_of(x) >> 31) ? 8 : 0) | c);
}

// The same function without comparisons or branches, for the GPU quantize pass (tested equal on
// every float: MxCodec.FastE2M1EqualsTheCodecOnEveryFloat). The magnitude code of a non-NaN |x|
// (its bits b): E2M1's grid step is 2^(e-1) for |x| in [2^e, 2^(e+1)), e = 0..2 (0.5 below 1 as
// well), which is the ulp of M = 2^(e+22); so one fp32 addition |x| + M rounds |x| to the grid, ties
// to even as the hardware adds, and the sum's bits above M's count the steps n. The code is
// n + 2e, saturated at 7 (e clamped to 3 keeps M finite and every |x| >= 8 above 7).
DMATTN_HD uint32_t e2m1_magnitude_code(uint32_t b) {
  uint32_t eb = b & 0x7F800000u;  // 2^e's exponent field
  eb = eb < 0x3F800000u ? 0x3F800000u : eb > 0x41000000u ? 0x41000000u : eb;
  const uint32_t m = eb + (22u << 23);
#if defined(__CUDA_ARCH__)
  const float sum = __fadd_rn(hd::float_of(b), hd::float_of(m));  // never contracted into an FMA
#else
  const float sum = hd::float_of(b) + hd::float_of(m);
#endif
  const uint32_t c = hd::bits_of(sum) - m + ((m >> 22) - 298u);  // n + 2e
  return c < 7u ? c : 7u;
}
// encode_e2m1_fast for a value known not to be NaN (the elements of a block whose scale is not NaN).
DMATTN_HD uint8_t encode_e2m1_not_nan(float x) {
  const uint32_t u = hd::bits_of(x);
  return uint8_t(((u >> 28) & 8u) | e2m1_magnitude_code(u & 0x7FFFFFFFu));
}
DMATTN_HD uint8_t encode_e2m1_fast(float x) { return hd::is_nan(x) ? uint8_t(0) : encode_e2m1_not_nan(x); }

DMATTN_HD uint8_t encode_elem(const ElemSpec& s, float x) {
  if (s.ebits == 2 && s.mbits == 1) return encode_e2m1(x);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // FP8 on sm_89+: the hardware conversion (RNE, saturating to max finite) is the same function.
  if (s.ebits + s.mbits == 7 && !hd::is_nan(x)) {
    uint16_t r;
    if (s.ebits == 4)
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    else
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return uint8_t(r & 0xFF);
  }
#endif
  const int nb = s.ebits + s.mbits;
  if (hd::is_nan(x)) return s.has_nan ? uint8_t((1 << (nb + 1)) - 1) : uint8_t(0);
  const uint8_t sign = (hd::bits_of(x) >> 31) ? uint8_t(1 << nb) : uint8_t(0);
  const float a = hd::abs_f(x);
  if (a >= s.max) return sign | s.max_code;
  if (a == 0.0f) return sign;
  const int emin = 1 - s.bias;
  int ex = hd::ilog2(a);
  if (ex < emin) ex = emin;
  // a / 2^(ex - mbits) lies in [0, 2^(mbits+1)); rounding it is rounding to the format's grid.
  int q = int(hd::rint_even(hd::ldexp2(a, s.mbits - ex)));
  const int one = 1 << s.mbits;
  if (q == 2 * one) {  // rounded up into the next binade
    q = one;
    ++ex;
  }
  const int ef = q >= one ? ex + s.bias : 0;  // q < one only happens in the subnormal binade
  const int mf = q >= one ? q - one : q;
  return uint8_t(sign | (ef << s.mbits) | mf);
}

DMATTN_HD uint8_t encode_elem(Elem e, float x) { return encode_elem(elem_spec(e), x); }

// ---- E8M0 shared scales -----------------------------------------------------------------------
inline constexpr uint8_t kE8M0NaN = 0xFF;

// 2^(code - 127) built from its bits (the GPU kernels call it per key): code 0 is the subnormal
// 2^-127, every other code an exponent field.
DMATTN_HD float decode_e8m0(uint8_t code) {
  if (code == kE8M0NaN) return hd::float_of(0x7FC00000u);
  return hd::float_of(code == 0 ? 0x00400000u : uint32_t(code) << 23);
}

// 1 / 2^(code - 127) = 2^(127 - code) for a non-NaN code, from its bits: the factor that brings a
// block's values to element range (code 254 gives the subnormal 2^-127, exact).
DMATTN_HD float inverse_e8m0(uint8_t code) {
  return hd::float_of(code < 254 ? uint32_t(254 - code) << 23 : 0x00400000u);
}

// choose_e8m0 without branches for a finite amax >= 0 (the GPU quantize pass, the decode's P blocks, and
// choose_e8m0's own normal case): the scale exponent from amax's exponent field (amax / 2^x keeps amax's
// significand, so with the ceil rule it is above max exactly where the mantissa bits are), clamped. A
// zero or subnormal amax (field 0) then clamps to code 0, as in choose_e8m0, for every element type
// (emax >= 2: -127 - emax + 1 < -127).
DMATTN_HD uint8_t choose_e8m0_nonneg(float amax, Elem e, ScaleRule rule) {
  const ElemSpec s = elem_spec(e);
  const uint32_t b = hd::bits_of(amax);
  // For a finite amax the code (exponent - emax + 127) is at most 254 - emax + 1 <= 253 (every element
  // type's emax is 2 or more): only the bottom clamp can act.
  const int c = int(b >> 23) - s.emax + int(rule == ScaleRule::ceil && (b & 0x7FFFFFu) > (hd::bits_of(s.max) & 0x7FFFFFu));
  return uint8_t(c < 0 ? 0 : c);
}

// The E8M0 scale code for a block whose largest magnitude is `amax` (NaN or Inf amax -> NaN
// scale; an all-zero block gets the smallest scale, 2^-127).
DMATTN_HD uint8_t choose_e8m0(float amax, Elem e, ScaleRule rule) {
  if (!hd::is_finite(amax)) return kE8M0NaN;
  if (amax == 0.0f) return 0;
  if (hd::bits_of(amax) - 0x00800000u < 0x7F000000u) return choose_e8m0_nonneg(amax, e, rule);  // positive normal
  const ElemSpec s = elem_spec(e);
  int x = hd::ilog2(amax) - s.emax;
  if (rule == ScaleRule::ceil && hd::ldexp2(amax, -x) > s.max) ++x;
  if (x < -127) x = -127;
  if (x > 127) x = 127;
  return uint8_t(x + 127);
}

// Quantizes one MX block of n values (n <= 32 in MX; any n works) to element codes + scale.
// Returns the E8M0 code; codes[i] receives the element code of v[i] (not packed).
DMATTN_HD uint8_t quantize_mx_block(const float* v, int n, Elem e, ScaleRule rule, uint8_t* codes) {
  float amax = 0.0f;
  bool bad = false;
  DMATTN_UNROLL
  for (int i = 0; i < n; ++i) {
    bad |= !hd::is_finite(v[i]);
    const float a = hd::abs_f(v[i]);
    amax = a > amax ? a : amax;
  }
  const uint8_t sc = bad ? kE8M0NaN : choose_e8m0(amax, e, rule);
  const int x = int(sc) - 127;
  const ElemSpec spec = elem_spec(e);  // once per block, not per element
  DMATTN_UNROLL
  for (int i = 0; i < n; ++i) codes[i] = sc == kE8M0NaN ? uint8_t(0) : encode_elem(spec, hd::ldexp2(v[i], -x));
  return sc;
}

// ---- NVFP4: E2M1 elements, 16-element blocks, E4M3 block scale, one fp32 scale per tensor -------
inline constexpr int kNvfp4Block = 16;

// The per-tensor scale: maps the tensor's amax onto the largest block scale x element product.
DMATTN_HD float nvfp4_tensor_scale(float tensor_amax) {
  return tensor_amax > 0.0f ? tensor_amax / (448.0f * 6.0f) : 1.0f;
}

// Quantizes one NVFP4 block; returns the E4M3 block-scale code. The block's effective scale is
// decode_elem(e4m3, code) * tensor_scale, and elements are RNE(v / effective scale), saturating.
DMATTN_HD uint8_t quantize_nvfp4_block(const float* v, int n, float tensor_scale, uint8_t* codes) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = hd::abs_f(v[i]);
    amax = a > amax ? a : amax;
  }
  const uint8_t sc = encode_elem(Elem::e4m3, amax / 6.0f / tensor_scale);
  const float eff = decode_elem(Elem::e4m3, sc) * tensor_scale;
  for (int i = 0; i < n; ++i) codes[i] = eff == 0.0f ? uint8_t(0) : encode_elem(Elem::e2m1, v[i] / eff);
  return sc;
}

}  // namespace dmattn
