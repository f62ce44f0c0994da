// bf16 / fp16 conversions against the compiler's _Float16 and a brute-force bf16 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

TEST(Numeric, Fp16DecodeMatchesCompilerOnEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    _Float16 h;
    const uint16_t bits = uint16_t(b);
    std::memcpy(&h, &bits, 2);
    const float want = float(h), got = to_float(fp16{bits});
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got));
    else
      EXPECT_EQ(got, want) << b;
  }
}

TEST(Numeric, Fp16EncodeMatchesCompiler) {
  Rng rng(1);
  for (int i = 0; i < 200000; ++i) {
    const float x = float(rng.normal() * std::ldexp(1.0, int(rng.next_u64() % 48) - 30));
    const _Float16 h = _Float16(x);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    EXPECT_EQ(to_fp16(x).bits, want) << x;
  }
  // Every fp16 value and every midpoint between neighbours.
  for (uint32_t b = 0; b < 0x7C00; ++b) {
    const float v = to_float(fp16{uint16_t(b)});
    EXPECT_EQ(to_fp16(v).bits, b);
    const float next = to_float(fp16{uint16_t(b + 1)});
    const float mid = (v + next) / 2;
    const _Float16 h = _Float16(mid);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    EXPECT_EQ(to_fp16(mid).bits, want) << mid;
  }
}

TEST(Numeric, Bf16RoundsToNearestEven) {
  Rng rng(2);
  for (int i = 0; i < 200000; ++i) {
    const float x = float(rng.normal() * std::ldexp(1.0, int(rng.next_u64() % 200) - 100));
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t lo = u & 0xFFFF0000u, hi = lo + 0x10000u;
    float flo, fhi;
    std::memcpy(&flo, &lo, 4);
    std::memcpy(&fhi, &hi, 4);
    const double dlo = std::fabs(double(x) - flo), dhi = std::fabs(double(fhi) - x);
    const uint32_t want = dlo < dhi ? lo : dhi < dlo ? hi : (((lo >> 16) & 1) ? hi : lo);
    EXPECT_EQ(uint32_t(to_bf16(x).bits) << 16, want) << x;
  }
  EXPECT_EQ(round_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);                             // tie -> even
  EXPECT_EQ(round_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));  // tie -> even (up)
  EXPECT_TRUE(std::isnan(round_bf16(std::nanf(""))));
}
