// Packed quantization, its inverse, and agreement with the decoded-value path backends use.
#include <gtest/gtest.h>

#include <cmath>

#include "dmattn/error.hpp"
#include "dmattn/quantize.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {
std::vector<float> normal(size_t n, uint64_t seed, double sigma = 1.0) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = float(rng.normal() * sigma);
  return v;
}
const Format kCoded[] = {Format::mxfp8_e4m3, Format::mxfp8_e5m2, Format::mxfp6_e3m2,
                         Format::mxfp6_e2m3, Format::mxfp4,      Format::nvfp4};
}  // namespace

TEST(Quantize, Fp4PacksLowNibbleFirst) {
  const float x[4] = {0.5f, 6.0f, -1.0f, 0.0f};  // amax 6 -> scale 2^0 (ocp, E2M1 emax 2)
  const Quantized q = quantize(x, 1, 4, Format::mxfp4, ScaleRule::ocp);
  ASSERT_EQ(q.codes.size(), 2u);
  EXPECT_EQ(q.codes[0], 0x71);  // 0.5 -> 0x1 (low), 6 -> 0x7 (high)
  EXPECT_EQ(q.codes[1], 0x0A);  // -1 -> 0xA (low), 0 -> 0x0 (high)
  EXPECT_EQ(q.scales[0], 127);
}

TEST(Quantize, DequantizeMatchesDecodedValuesForEveryFormat) {
  const int64_t rows = 7, cols = 128;
  const std::vector<float> x = normal(size_t(rows * cols), 1, 3.0);
  for (Format f : kCoded) {
    for (ScaleRule rule : {ScaleRule::ocp, ScaleRule::ceil}) {
      const Quantized q = quantize(x.data(), rows, cols, f, rule);
      EXPECT_EQ(q.scale_cols(), cols / format_info(f).block);
      const std::vector<float> dq = dequantize(q);
      const int blk = value_block(f);
      std::vector<float> e(cols), s(size_t(cols / blk));
      double err2 = 0, ref2 = 0;
      for (int64_t r = 0; r < rows; ++r) {
        quantize_row_values(x.data() + r * cols, int(cols), f, rule, q.tensor_scale, e.data(), s.data());
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(dq[size_t(r * cols + c)], e[size_t(c)] * s[size_t(c / blk)]) << format_name(f);
          const double d = dq[size_t(r * cols + c)] - x[size_t(r * cols + c)];
          err2 += d * d;
          ref2 += double(x[size_t(r * cols + c)]) * x[size_t(r * cols + c)];
        }
      }
      // Quantization error sits where the element's mantissa width puts it.
      const double rel = std::sqrt(err2 / ref2);
      const int mbits = format_info(f).elem == Elem::e2m1 ? 1 : (f == Format::mxfp8_e4m3 || f == Format::mxfp6_e2m3) ? 3 : 2;
      EXPECT_LT(rel, std::ldexp(1.0, -mbits)) << format_name(f);
      EXPECT_GT(rel, std::ldexp(1.0, -mbits - 6)) << format_name(f);
    }
  }
}

// Under the ocp rule a block's largest element stays in its binade when rounded (it lands in
// [2^emax, max]), so the scale and every code survive a second pass. (Not so under ceil: an amax
// just above max/2 can round down to max/2 and take a smaller scale.)
TEST(Quantize, RequantizingDequantizedValuesIsStable) {
  const std::vector<float> x = normal(64 * 32, 2);
  for (Format f : kCoded) {
    if (f == Format::nvfp4) continue;  // the tensor scale moves with the amax; MX scales do not
    const Quantized q = quantize(x.data(), 64, 32, f, ScaleRule::ocp);
    const std::vector<float> dq = dequantize(q);
    const Quantized q2 = quantize(dq.data(), 64, 32, f, ScaleRule::ocp);
    EXPECT_EQ(q.codes, q2.codes) << format_name(f);
    EXPECT_EQ(q.scales, q2.scales) << format_name(f);
  }
}

TEST(Quantize, PartialLastBlockAndOddFp4Length) {
  const std::vector<float> x = normal(3 * 45, 3);
  const Quantized q = quantize(x.data(), 3, 45, Format::mxfp4, ScaleRule::ocp);
  EXPECT_EQ(q.code_cols(), 23);
  EXPECT_EQ(q.scale_cols(), 2);
  const std::vector<float> dq = dequantize(q);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(dq[i], x[i], 0.5 * std::fabs(x[i]) + 0.3);
}

TEST(Quantize, Nvfp4TensorScaleAndBf16HasNoCodes) {
  const std::vector<float> x = normal(4 * 64, 4);
  const Quantized q = quantize(x.data(), 4, 64, Format::nvfp4, ScaleRule::ocp);
  EXPECT_EQ(q.tensor_scale, abs_max(x.data(), 4 * 64) / 2688.0f);
  EXPECT_EQ(q.scale_cols(), 4);
  EXPECT_THROW(quantize(x.data(), 4, 64, Format::bf16, ScaleRule::ocp), Error);
  EXPECT_THROW(parse_format("mxfp3"), Error);
  EXPECT_EQ(parse_format("mxfp8"), Format::mxfp8_e4m3);
  for (Format f : kCoded) EXPECT_EQ(parse_format(format_name(f)), f);
}
