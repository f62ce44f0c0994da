// Host/device portability helpers shared by the codec and every backend.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DMATTN_HD __host__ __device__ __forceinline__
#else
#define DMATTN_HD inline
#endif

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

// Full unrolling on the device keeps small per-block arrays in registers, not local memory.
#if defined(__CUDA_ARCH__)
#define DMATTN_UNROLL _Pragma("unroll")
#else
#define DMATTN_UNROLL
#endif

namespace dmattn::hd {

// Reinterprets the bits of a trivially copyable value (memcpy lowers to a register move, on the
// device too).
template <class To, class From>
DMATTN_HD To bit_cast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To t;
  std::memcpy(&t, &x, sizeof t);
  return t;
}

DMATTN_HD uint32_t bits_of(float x) { return bit_cast<uint32_t>(x); }
DMATTN_HD float float_of(uint32_t u) { return bit_cast<float>(u); }

// x * 2^e, correctly rounded (exact whenever the result is a normal float). When 2^e is itself a
// normal float, one multiplication does it; that is the hot case, so it avoids the libm call.
DMATTN_HD float ldexp2(float x, int e) {
  if (e >= -126 && e <= 127) return x * float_of(uint32_t(e + 127) << 23);
#if defined(__CUDA_ARCH__)
  return ldexpf(x, e);
#else
  return std::ldexp(x, e);
#endif
}

// floor(log2 |x|) for finite non-zero x, subnormals included.
DMATTN_HD int ilog2(float x) {
  const int ef = int((bits_of(x) >> 23) & 0xFF);
  if (ef != 0) return ef - 127;
#if defined(__CUDA_ARCH__)
  return ilogbf(x);
#else
  return std::ilogb(x);
#endif
}

// Round to nearest integer, ties to even (the default IEEE rounding mode, which we never change).
DMATTN_HD float rint_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::rint(x);
#endif
}

// Division rounding towards minus infinity (b > 0): query positions can be negative.
DMATTN_HD int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

DMATTN_HD bool is_finite(float x) { return (bits_of(x) & 0x7F800000u) != 0x7F800000u; }
DMATTN_HD bool is_nan(float x) { return (bits_of(x) & 0x7FFFFFFFu) > 0x7F800000u; }
DMATTN_HD float abs_f(float x) { return float_of(bits_of(x) & 0x7FFFFFFFu); }

}  // namespace dmattn::hd
