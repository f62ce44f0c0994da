// The codec against an independent construction of every format's value set, plus the encode
// properties: round trip, nearest with ties to even, saturation; and the block scale rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

struct Case {
  Elem e;
  int ebits, mbits, bias;
  bool ieee_specials;  // E5M2: exponent all-ones is Inf/NaN
  bool e4m3_nan;       // E4M3: only S.1111.111 is NaN
  double max;
};

const Case kCases[] = {
    {Elem::e4m3, 4, 3, 7, false, true, 448.0},   {Elem::e5m2, 5, 2, 15, true, false, 57344.0},
    {Elem::e3m2, 3, 2, 3, false, false, 28.0},   {Elem::e2m3, 2, 3, 1, false, false, 7.5},
    {Elem::e2m1, 2, 1, 1, false, false, 6.0},
};

// Independent value of a code, in double, from the spec's case table.
double brute_value(const Case& c, unsigned code) {
  const unsigned n = 1 + c.ebits + c.mbits;
  const bool neg = (code >> (n - 1)) & 1;
  const unsigned ef = (code >> c.mbits) & ((1u << c.ebits) - 1);
  const unsigned mf = code & ((1u << c.mbits) - 1);
  double v;
  if (c.ieee_specials && ef == (1u << c.ebits) - 1)
    v = mf == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  else if (c.e4m3_nan && ef == 15 && mf == 7)
    v = std::numeric_limits<double>::quiet_NaN();
  else if (ef == 0)
    v = std::pow(2.0, 1 - c.bias) * (mf / std::pow(2.0, c.mbits));
  else
    v = std::pow(2.0, int(ef) - c.bias) * (1.0 + mf / std::pow(2.0, c.mbits));
  return neg ? -v : v;
}

unsigned n_codes(const Case& c) { return 1u << (1 + c.ebits + c.mbits); }

// Brute-force nearest finite code (ties to the even code), saturating, for finite x.
unsigned brute_encode(const Case& c, double x) {
  unsigned best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (unsigned code = 0; code < n_codes(c); ++code) {
    const double v = brute_value(c, code);
    if (!std::isfinite(v)) continue;
    if (v == 0 && std::signbit(v) != std::signbit(x)) continue;  // zero keeps the sign of x
    const double err = std::fabs(v - x);
    if (err < best_err || (err == best_err && (code & 1) == 0 && v != 0)) {
      best = code;
      best_err = err;
    }
  }
  return best;
}

}  // namespace

TEST(MxCodec, EveryCodeDecodesToItsSpecValue) {
  for (const Case& c : kCases) {
    for (unsigned code = 0; code < n_codes(c); ++code) {
      const double want = brute_value(c, code);
      const float got = decode_elem(c.e, uint8_t(code));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << "elem " << int(c.e) << " code " << code;
      } else {
        EXPECT_EQ(double(got), want) << "elem " << int(c.e) << " code " << code;
        EXPECT_EQ(std::signbit(got), std::signbit(want));
      }
    }
  }
}

TEST(MxCodec, SpecAnchors) {
  EXPECT_EQ(decode_elem(Elem::e4m3, 0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(decode_elem(Elem::e4m3, 0x7F)));
  EXPECT_EQ(decode_elem(Elem::e4m3, 0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(decode_elem(Elem::e5m2, 0x7B), 57344.0f);
  EXPECT_TRUE(std::isinf(decode_elem(Elem::e5m2, 0x7C)));
  EXPECT_EQ(decode_elem(Elem::e5m2, 0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(decode_elem(Elem::e3m2, 0x1F), 28.0f);
  EXPECT_EQ(decode_elem(Elem::e2m3, 0x1F), 7.5f);
  const float fp4[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(decode_elem(Elem::e2m1, uint8_t(i)), fp4[i]);
    EXPECT_EQ(decode_elem(Elem::e2m1, uint8_t(i | 8)), -fp4[i]);
  }
  for (const Case& c : kCases) {
    EXPECT_EQ(elem_spec(c.e).max, float(c.max));
    EXPECT_EQ(decode_elem(c.e, elem_spec(c.e).max_code), float(c.max));
  }
}

TEST(MxCodec, E5M2IsTheTopByteOfFp16) {
  for (unsigned code = 0; code < 256; ++code) {
    _Float16 h;
    const uint16_t bits = uint16_t(code << 8);
    std::memcpy(&h, &bits, 2);
    const float want = float(h), got = decode_elem(Elem::e5m2, uint8_t(code));
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got));
    else
      EXPECT_EQ(got, want) << code;
  }
}

TEST(MxCodec, EncodeOfDecodeIsIdentityOnEveryNonNaNCode) {
  for (const Case& c : kCases) {
    for (unsigned code = 0; code < n_codes(c); ++code) {
      const float v = decode_elem(c.e, uint8_t(code));
      if (std::isnan(v) || std::isinf(v)) continue;
      EXPECT_EQ(encode_elem(c.e, v), code) << "elem " << int(c.e) << " value " << v;
    }
  }
}

TEST(MxCodec, MidpointsRoundToEven) {
  for (const Case& c : kCases) {
    const unsigned half = n_codes(c) / 2;
    for (unsigned code = 0; code + 1 < half; ++code) {
      const double a = brute_value(c, code), b = brute_value(c, code + 1);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const float mid = float((a + b) / 2);  // exact: the formats have few mantissa bits
      ASSERT_EQ(double(mid), (a + b) / 2);
      const unsigned even = (code % 2 == 0) ? code : code + 1;
      EXPECT_EQ(encode_elem(c.e, mid), even) << "elem " << int(c.e) << " between " << a << " and " << b;
      EXPECT_EQ(encode_elem(c.e, -mid), even | half) << "elem " << int(c.e);
      EXPECT_EQ(encode_elem(c.e, std::nextafter(mid, 0.0f)), code);
      EXPECT_EQ(encode_elem(c.e, std::nextafter(mid, 1e9f)), code + 1);
    }
  }
}

TEST(MxCodec, EncodeIsNearestOnRandomValues) {
  Rng rng(7);
  for (const Case& c : kCases) {
    for (int i = 0; i < 20000; ++i) {
      const float x = float(rng.normal() * std::ldexp(1.0, int(rng.next_u64() % 24) - 12));
      EXPECT_EQ(encode_elem(c.e, x), brute_encode(c, x)) << "elem " << int(c.e) << " x " << x;
    }
  }
}

TEST(MxCodec, SaturatesAndHandlesSpecials) {
  for (const Case& c : kCases) {
    const ElemSpec s = elem_spec(c.e);
    const uint8_t neg = uint8_t(1 << (s.ebits + s.mbits));
    EXPECT_EQ(encode_elem(c.e, 1e30f), s.max_code);
    EXPECT_EQ(encode_elem(c.e, -1e30f), neg | s.max_code);
    EXPECT_EQ(encode_elem(c.e, std::numeric_limits<float>::infinity()), s.max_code);
    EXPECT_EQ(encode_elem(c.e, s.max * 1.07f), s.max_code);
    EXPECT_EQ(encode_elem(c.e, 0.0f), 0);
    EXPECT_EQ(encode_elem(c.e, -0.0f), neg);
    EXPECT_EQ(encode_elem(c.e, 1e-30f), 0);  // underflows to zero
    const float nan_dec = decode_elem(c.e, encode_elem(c.e, std::nanf("")));
    if (s.has_nan)
      EXPECT_TRUE(std::isnan(nan_dec));
    else
      EXPECT_EQ(nan_dec, 0.0f);
  }
  EXPECT_EQ(encode_elem(Elem::e4m3, 470.0f), 0x7E);  // would round to 480, the NaN code: saturates
}

// The GPU pass's branch-free E2M1 encoder against the codec's, on all 2^32 float bit patterns.
TEST(MxCodec, FastE2M1EqualsTheCodecOnEveryFloat) {
  constexpr int64_t kChunks = 256;  // of 2^24 patterns, on every core (~20 s on one)
  std::vector<uint64_t> mismatches(kChunks, 0), first(kChunks, 0);
  cpu::parallel_for(kChunks, 0, [&](int64_t c) {
    for (uint64_t i = uint64_t(c) << 24; i < uint64_t(c + 1) << 24; ++i) {
      const float x = hd::float_of(uint32_t(i));
      if (encode_e2m1_fast(x) != encode_e2m1(x) && mismatches[size_t(c)]++ == 0) first[size_t(c)] = i;
    }
  });
  for (int64_t c = 0; c < kChunks; ++c) EXPECT_EQ(mismatches[size_t(c)], 0u) << "first at bits 0x" << std::hex << first[size_t(c)];
}

// choose_e8m0's bit-level fast path against the definition (ilogb, ldexp), every rule and element
// type, on a stride through all positive floats (normals, subnormals, and their edges).
TEST(MxScale, ChoiceEqualsTheDefinitionOnAStrideOfFloats) {
  int64_t checked = 0;
  for (uint64_t i = 1; i < 0x7F800000ull; i += (i < 0x01000000ull ? 61 : 7919)) {
    const float a = hd::float_of(uint32_t(i));
    for (Elem e : {Elem::e4m3, Elem::e5m2, Elem::e3m2, Elem::e2m3, Elem::e2m1})
      for (ScaleRule rule : {ScaleRule::ocp, ScaleRule::ceil}) {
        const ElemSpec s = elem_spec(e);
        int x = std::ilogb(a) - s.emax;
        if (rule == ScaleRule::ceil && std::ldexp(a, -x) > s.max) ++x;
        x = std::clamp(x, -127, 127);
        ASSERT_EQ(choose_e8m0(a, e, rule), uint8_t(x + 127)) << a << " " << int(e) << " " << int(rule);
        ++checked;
      }
  }
  EXPECT_GT(checked, 2000000);
}

// The branch-free choice for non-negative finite amax (the GPU decode's P blocks) against choose_e8m0:
// a stride through every such float, and every binade's zero, subnormal and mantissa edges.
TEST(MxScale, NonNegativeChoiceEqualsTheGeneralOne) {
  auto check = [](uint32_t bits) {
    const float a = hd::float_of(bits);
    for (Elem e : {Elem::e4m3, Elem::e5m2, Elem::e3m2, Elem::e2m3, Elem::e2m1})
      for (ScaleRule rule : {ScaleRule::ocp, ScaleRule::ceil})
        ASSERT_EQ(choose_e8m0_nonneg(a, e, rule), choose_e8m0(a, e, rule)) << a << " " << int(e) << " " << int(rule);
  };
  for (uint32_t b = 0; b < 0x7F800000u; b += 257) check(b);
  for (uint32_t ex = 0; ex < 255; ++ex)
    for (uint32_t m : {0u, 1u, 0x1FFFFFu, 0x200000u, 0x200001u, 0x3FFFFFu, 0x400000u, 0x5FFFFFu, 0x600000u, 0x600001u, 0x7FFFFFu})
      check(ex << 23 | m);
}

TEST(MxScale, InverseIsTheReciprocalOfEveryCode) {
  for (int c = 0; c < 255; ++c) {
    EXPECT_EQ(inverse_e8m0(uint8_t(c)), hd::ldexp2(1.0f, 127 - c)) << c;
    EXPECT_EQ(inverse_e8m0(uint8_t(c)) * decode_e8m0(uint8_t(c)), 1.0f) << c;
  }
}

TEST(MxScale, OcpRuleIsFloorLog2MinusEmax) {
  EXPECT_EQ(choose_e8m0(1.0f, Elem::e4m3, ScaleRule::ocp), 127 - 8);
  EXPECT_EQ(choose_e8m0(448.0f, Elem::e4m3, ScaleRule::ocp), 127);
  EXPECT_EQ(choose_e8m0(500.0f, Elem::e4m3, ScaleRule::ocp), 127);
  EXPECT_EQ(choose_e8m0(6.0f, Elem::e2m1, ScaleRule::ocp), 127);
  EXPECT_EQ(choose_e8m0(7.0f, Elem::e2m1, ScaleRule::ocp), 127);
  EXPECT_EQ(choose_e8m0(0.0f, Elem::e2m1, ScaleRule::ocp), 0);
  EXPECT_EQ(choose_e8m0(1e-44f, Elem::e4m3, ScaleRule::ocp), 0);          // clamped at 2^-127
  EXPECT_EQ(choose_e8m0(3e38f, Elem::e2m1, ScaleRule::ocp), 127 + 125);   // 2^127 range: 127 - 2
  EXPECT_EQ(choose_e8m0(std::nanf(""), Elem::e2m1, ScaleRule::ocp), kE8M0NaN);
  EXPECT_EQ(choose_e8m0(std::numeric_limits<float>::infinity(), Elem::e4m3, ScaleRule::ceil), kE8M0NaN);
  EXPECT_TRUE(std::isnan(decode_e8m0(kE8M0NaN)));
  EXPECT_EQ(decode_e8m0(127), 1.0f);
  EXPECT_EQ(decode_e8m0(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(decode_e8m0(254), std::ldexp(1.0f, 127));
}

TEST(MxScale, CeilRuleIsSmallestNonSaturatingExponent) {
  EXPECT_EQ(choose_e8m0(500.0f, Elem::e4m3, ScaleRule::ceil), 128);
  EXPECT_EQ(choose_e8m0(448.0f, Elem::e4m3, ScaleRule::ceil), 127);
  EXPECT_EQ(choose_e8m0(7.0f, Elem::e2m1, ScaleRule::ceil), 128);
  Rng rng(3);
  for (const Case& c : kCases) {
    for (int i = 0; i < 5000; ++i) {
      const float amax = float(std::fabs(rng.normal()) * std::ldexp(1.0, int(rng.next_u64() % 60) - 30));
      if (amax == 0) continue;
      const int xc = choose_e8m0(amax, c.e, ScaleRule::ceil) - 127;
      EXPECT_LE(std::ldexp(double(amax), -xc), c.max);
      EXPECT_GT(std::ldexp(double(amax), -(xc - 1)), c.max);
      const int xo = choose_e8m0(amax, c.e, ScaleRule::ocp) - 127;
      const double r = std::ldexp(double(amax), -xo);
      EXPECT_GE(r, std::ldexp(1.0, elem_spec(c.e).emax));
      EXPECT_LT(r, std::ldexp(1.0, elem_spec(c.e).emax + 1));
    }
  }
}

TEST(MxBlock, ZeroNaNAndRoundTrip) {
  float zeros[32] = {};
  uint8_t codes[32];
  for (const Case& c : kCases) {
    EXPECT_EQ(quantize_mx_block(zeros, 32, c.e, ScaleRule::ocp, codes), 0);
    for (uint8_t code : codes) EXPECT_EQ(decode_elem(c.e, code), 0.0f);
  }
  float v[32];
  Rng rng(11);
  for (float& x : v) x = float(rng.normal());
  v[5] = std::nanf("");
  EXPECT_EQ(quantize_mx_block(v, 32, Elem::e4m3, ScaleRule::ocp, codes), kE8M0NaN);
  v[5] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(quantize_mx_block(v, 32, Elem::e2m1, ScaleRule::ceil, codes), kE8M0NaN);
  // Finite blocks: each element is the nearest grid value of v / 2^X (saturating) times 2^X.
  for (const Case& c : kCases) {
    for (ScaleRule rule : {ScaleRule::ocp, ScaleRule::ceil}) {
      for (int t = 0; t < 200; ++t) {
        const double mag = std::ldexp(1.0, int(rng.next_u64() % 40) - 20);
        for (float& x : v) x = float(rng.normal() * mag);
        const uint8_t sc = quantize_mx_block(v, 32, c.e, rule, codes);
        const int x = int(sc) - 127;
        for (int i = 0; i < 32; ++i) {
          EXPECT_EQ(codes[i], brute_encode(c, std::ldexp(double(v[i]), -x)));
          if (rule == ScaleRule::ceil) EXPECT_LE(std::fabs(decode_elem(c.e, codes[i])), c.max);
        }
      }
    }
  }
}

TEST(Nvfp4, BlockScaleAndElements) {
  float v[16];
  uint8_t codes[16];
  Rng rng(5);
  for (float& x : v) x = float(rng.normal());
  float amax = 0;
  for (float x : v) amax = std::max(amax, std::fabs(x));
  const float ts = nvfp4_tensor_scale(amax * 4);  // this block is a quarter of the tensor's amax
  EXPECT_EQ(ts, amax * 4 / 2688.0f);
  const uint8_t sc = quantize_nvfp4_block(v, 16, ts, codes);
  EXPECT_EQ(sc, encode_elem(Elem::e4m3, amax / 6.0f / ts));
  const float eff = decode_elem(Elem::e4m3, sc) * ts;
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(codes[i], encode_elem(Elem::e2m1, v[i] / eff));
    EXPECT_LE(std::fabs(decode_elem(Elem::e2m1, codes[i]) * eff - v[i]), 0.26f * amax + 1e-6f);
  }
  float zeros[16] = {};
  EXPECT_EQ(quantize_nvfp4_block(zeros, 16, 1.0f, codes), 0);
  for (uint8_t c : codes) EXPECT_EQ(c, 0);
}
