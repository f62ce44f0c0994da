// GPU quantize kernel vs the CPU codec, bit for bit, on strided fp32/fp16/bf16 inputs, outputs
// poisoned before each launch. Skips (visibly) where no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <cstdio>
#include <vector>

#include "cuda/prepass/quantize.hpp"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/quantize.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

// rows x d normal values, element i of row r scaled by 2^level(r, i).
template <class F>
std::vector<float> leveled_rows(int64_t rows, int64_t d, uint64_t seed, F&& level) {
  Rng rng(seed);
  std::vector<float> x(size_t(rows * d));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < d; ++i) x[size_t(r * d + i)] = float(rng.normal() * std::ldexp(1.0, level(r, i)));
  return x;
}

}  // namespace

TEST(GpuQuantize, MatchesCpuCodecBitForBit) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t B = 2, H = 3, N = 77, d = 128;
  // Dense rows (128: the pass skips the row arithmetic), then rows padded to a strided view: 160 keeps
  // 16-byte alignment (vector loads), 132 breaks it for 16-bit dtypes (scalar loads).
  for (int64_t dpad : {128, 160, 132}) {
  const std::pair<Format, Format> pairs[] = {{Format::mxfp8_e4m3, Format::mxfp4},
                                             {Format::mxfp8_e5m2, Format::mxfp6_e3m2},
                                             {Format::mxfp6_e2m3, Format::mxfp6_e2m3}};
  Rng rng(1234);
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    // Host data in the padded layout, with a spread of magnitudes per row.
    std::vector<float> vals(size_t(B * H * N * dpad));
    for (size_t i = 0; i < vals.size(); ++i) vals[i] = float(rng.normal() * std::ldexp(1.0, int(i / dpad % 23) - 11));
    HostTensor host = HostTensor::from_floats(vals, {B, H, N, dpad}, dt);
    const std::vector<float> rounded = host.to_floats();  // values as the dtype holds them
    std::vector<float> rows(size_t(B * H * N * d));
    for (int64_t r = 0; r < B * H * N; ++r)
      for (int64_t i = 0; i < d; ++i) rows[size_t(r * d + i)] = rounded[size_t(r * dpad + i)];
    void* dx;
    CUDA_OK(cudaMalloc(&dx, host.nbytes()));
    CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
    TensorView view = TensorView::contiguous(dx, dt, {B, H, N, dpad}, Device::cuda);
    view.shape[3] = d;
    for (auto [f0, f1] : pairs)
      for (ScaleRule rule : {ScaleRule::ocp, ScaleRule::ceil}) {
        const Quantized want0 = quantize(rows.data(), B * H * N, d, f0, rule);
        const Quantized want1 = quantize(rows.data(), B * H * N, d, f1, rule);
        uint8_t *c0, *s0, *c1, *s1;
        CUDA_OK(cudaMalloc(&c0, want0.codes.size()));
        CUDA_OK(cudaMalloc(&s0, want0.scales.size()));
        CUDA_OK(cudaMalloc(&c1, want1.codes.size()));
        CUDA_OK(cudaMalloc(&s1, want1.scales.size()));
        CUDA_OK(cudaMemset(c0, 0xA5, want0.codes.size()));  // poison
        CUDA_OK(cudaMemset(s0, 0xA5, want0.scales.size()));
        CUDA_OK(cudaMemset(c1, 0xA5, want1.codes.size()));
        CUDA_OK(cudaMemset(s1, 0xA5, want1.scales.size()));
        cuda::quantize_rows(view, rule, {f0, c0, s0}, {f1, c1, s1}, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<uint8_t> g0(want0.codes.size()), gs0(want0.scales.size()), g1(want1.codes.size()),
            gs1(want1.scales.size());
        CUDA_OK(cudaMemcpy(g0.data(), c0, g0.size(), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gs0.data(), s0, gs0.size(), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(g1.data(), c1, g1.size(), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gs1.data(), s1, gs1.size(), cudaMemcpyDeviceToHost));
        EXPECT_EQ(g0, want0.codes) << format_name(f0) << " " << dtype_name(dt);
        EXPECT_EQ(gs0, want0.scales) << format_name(f0) << " " << dtype_name(dt);
        EXPECT_EQ(g1, want1.codes) << format_name(f1) << " " << dtype_name(dt);
        EXPECT_EQ(gs1, want1.scales) << format_name(f1) << " " << dtype_name(dt);
        // The second format alone (MXFP4 alone has its own instance).
        CUDA_OK(cudaMemset(c1, 0xA5, want1.codes.size()));
        CUDA_OK(cudaMemset(s1, 0xA5, want1.scales.size()));
        cuda::quantize_rows(view, rule, {f1, c1, s1}, {}, nullptr);
        CUDA_OK(cudaMemcpy(g1.data(), c1, g1.size(), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(gs1.data(), s1, gs1.size(), cudaMemcpyDeviceToHost));
        EXPECT_EQ(g1, want1.codes) << format_name(f1) << " alone, " << dtype_name(dt);
        EXPECT_EQ(gs1, want1.scales) << format_name(f1) << " alone, " << dtype_name(dt);
        cudaFree(c0);
        cudaFree(s0);
        cudaFree(c1);
        cudaFree(s1);
      }
    cudaFree(dx);
  }
  }
}

// Every finite bf16 and fp16 value below 8 in magnitude, as element of a block whose amax element (4)
// pins the E2M1 scale at 1: the quantize pass's f16-pair rounding (16-bit inputs) against the codec
// for each of them, in both the nibble and the FP8-byte forms, with the other formats of the pair.
TEST(GpuQuantize, E2M1OfEvery16BitValue) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (DType dt : {DType::bf16, DType::f16}) {
    std::vector<float> vals;
    for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
      const float x = dt == DType::bf16 ? to_float(bf16{uint16_t(bits)}) : to_float(fp16{uint16_t(bits)});
      if (std::isfinite(x) && std::fabs(x) < 8.0f) vals.push_back(x);
    }
    const int64_t blocks = int64_t(vals.size() + 30) / 31, d = 32;
    std::vector<float> x(size_t(blocks * d), 0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      x[size_t(b * d)] = b % 2 ? -4.0f : 4.0f;  // the block's amax: scale 2^0 (OCP, E2M1)
      for (int64_t i = 1; i < d; ++i) {
        const size_t at = size_t(b * 31 + i - 1);
        x[size_t(b * d + i)] = at < vals.size() ? vals[at] : 0.0f;
      }
    }
    const HostTensor host = HostTensor::from_floats(x, {1, 1, blocks, d}, dt);
    void* dx;
    CUDA_OK(cudaMalloc(&dx, host.nbytes()));
    CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
    const TensorView view = TensorView::contiguous(dx, dt, {1, 1, blocks, d}, Device::cuda);
    const std::vector<float> rounded = host.to_floats();
    for (ScaleRule rule : {ScaleRule::ocp, ScaleRule::ceil}) {
      const Quantized want = quantize(rounded.data(), blocks, d, Format::mxfp4, rule);
      const std::vector<float> want_values = dequantize(want);
      uint8_t *c8, *s8, *c4, *s4, *b4, *bs4;
      CUDA_OK(cudaMalloc(&c8, size_t(blocks * d)));
      CUDA_OK(cudaMalloc(&s8, size_t(blocks)));
      CUDA_OK(cudaMalloc(&c4, want.codes.size()));
      CUDA_OK(cudaMalloc(&s4, size_t(blocks)));
      CUDA_OK(cudaMalloc(&b4, size_t(blocks * d)));
      CUDA_OK(cudaMalloc(&bs4, size_t(blocks)));
      CUDA_OK(cudaMemset(c4, 0xA5, want.codes.size()));  // poison
      CUDA_OK(cudaMemset(b4, 0xA5, size_t(blocks * d)));
      // The (E4M3, E2M1) pair in the nibble form, then in the FP8-byte form (no fold: one block a row).
      cuda::quantize_rows(view, rule, {Format::mxfp8_e4m3, c8, s8}, {Format::mxfp4, c4, s4}, nullptr);
      cuda::quantize_rows(view, rule, {Format::mxfp8_e4m3, c8, s8, true}, {Format::mxfp4, b4, bs4, true}, nullptr);
      const size_t nb = static_cast<size_t>(blocks);
      std::vector<uint8_t> g4(want.codes.size()), gs4(nb), gb4(nb * 32), gbs4(nb);
      CUDA_OK(cudaMemcpy(g4.data(), c4, g4.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gs4.data(), s4, gs4.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gb4.data(), b4, gb4.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gbs4.data(), bs4, gbs4.size(), cudaMemcpyDeviceToHost));
      EXPECT_EQ(gs4, want.scales) << dtype_name(dt);
      EXPECT_EQ(gbs4, want.scales) << dtype_name(dt);
      for (size_t i = 0; i < g4.size(); ++i)
        ASSERT_EQ(g4[i], want.codes[i]) << dtype_name(dt) << " byte " << i << ": values " << rounded[2 * i] << ", "
                                        << rounded[2 * i + 1];
      for (size_t i = 0; i < gb4.size(); ++i)
        ASSERT_EQ(decode_elem(Elem::e4m3, gb4[i]) * decode_e8m0(gbs4[i / 32]), want_values[i])
            << dtype_name(dt) << " element " << i << ": value " << rounded[i];
      for (uint8_t* p : {c8, s8, c4, s4, b4, bs4}) cudaFree(p);
    }
    cudaFree(dx);
  }
}

TEST(GpuQuantize, RejectsWhatItCannotDo) {
  SKIP_WITHOUT_CUDA_DEVICE();
  uint8_t* buf;
  CUDA_OK(cudaMalloc(&buf, 1 << 16));
  TensorView v = TensorView::contiguous(buf, DType::bf16, {1, 1, 4, 64}, Device::cuda);
  EXPECT_THROW(cuda::quantize_rows(v, ScaleRule::ocp, {Format::nvfp4, buf, buf}, {}, nullptr), Error);
  EXPECT_THROW(cuda::quantize_rows(v, ScaleRule::ocp, {Format::bf16, buf, buf}, {}, nullptr), Error);
  v.device = Device::cpu;
  EXPECT_THROW(cuda::quantize_rows(v, ScaleRule::ocp, {Format::mxfp4, buf, buf}, {}, nullptr), Error);
  cudaFree(buf);
}

// NaN and Inf: the block gets the NaN scale and zero codes (as on the CPU) and the optional flag is
// raised; a finite tensor leaves the flag at 0.
TEST(GpuQuantize, FlagsNonFiniteValues) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t rows = 300, d = 64;
  Rng rng(5);
  for (float poison : {std::nanf(""), INFINITY, -INFINITY, 0.0f}) {
    std::vector<float> x(size_t(rows * d));
    for (float& v : x) v = float(rng.normal());
    x[size_t(257 * d + 40)] = poison;
    HostTensor host = HostTensor::from_floats(x, {1, 1, rows, d}, DType::bf16);
    const Quantized want = quantize(host.to_floats().data(), rows, d, Format::mxfp4, ScaleRule::ocp);
    void* dx;
    uint8_t *codes, *scales;
    int* flag;
    CUDA_OK(cudaMalloc(&dx, host.nbytes()));
    CUDA_OK(cudaMalloc(&codes, want.codes.size()));
    CUDA_OK(cudaMalloc(&scales, want.scales.size()));
    CUDA_OK(cudaMalloc(&flag, sizeof(int)));
    CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(codes, 0xA5, want.codes.size()));
    CUDA_OK(cudaMemset(scales, 0xA5, want.scales.size()));
    CUDA_OK(cudaMemset(flag, 0, sizeof(int)));
    const TensorView view = TensorView::contiguous(dx, DType::bf16, {1, 1, rows, d}, Device::cuda);
    cuda::quantize_rows(view, ScaleRule::ocp, {Format::mxfp4, codes, scales}, {}, nullptr, flag);
    std::vector<uint8_t> gc(want.codes.size()), gs(want.scales.size());
    int got_flag = -1;
    CUDA_OK(cudaMemcpy(gc.data(), codes, gc.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gs.data(), scales, gs.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&got_flag, flag, sizeof(int), cudaMemcpyDeviceToHost));
    EXPECT_EQ(gc, want.codes) << poison;
    EXPECT_EQ(gs, want.scales) << poison;
    EXPECT_EQ(gs[size_t(257 * 2 + 1)], poison == 0.0f ? want.scales[257 * 2 + 1] : kE8M0NaN) << poison;
    EXPECT_EQ(got_flag, poison == 0.0f ? 0 : 1) << poison;
    cudaFree(dx);
    cudaFree(codes);
    cudaFree(scales);
    cudaFree(flag);
  }
}

// Folding (QuantTarget::fold) changes codes and scales, never values: every element's FP8 byte x
// its scale equals the CPU codec's code x scale. Rows whose blocks' scales differ by a factor <= 4
// always fold for MXFP4 (a shifted E2M1 value stays an exact E4M3 value); MXFP8 rows fold only
// where no small value would round, so some do and some do not.
TEST(GpuQuantize, FoldingKeepsValuesAndUnifiesRowScales) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (int64_t d : {64, 128, 256}) {
    const int64_t rows = 512, nb = d / 32;
    // per-block magnitudes 2^0..2^2 over a per-row level
    const std::vector<float> x =
        leveled_rows(rows, d, uint64_t(99 + d), [](int64_t r, int64_t i) { return int((i / 32 + r) % 3) + int(r % 9) - 4; });
    HostTensor host = HostTensor::from_floats(x, {1, 1, rows, d}, DType::f32);
    void* dx;
    CUDA_OK(cudaMalloc(&dx, host.nbytes()));
    CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
    const TensorView view = TensorView::contiguous(dx, DType::f32, {1, 1, rows, d}, Device::cuda);
    for (Format f : {Format::mxfp4, Format::mxfp8_e4m3, Format::mxfp8_e5m2, Format::mxfp6_e3m2, Format::mxfp6_e2m3}) {
      const Quantized want = quantize(x.data(), rows, d, f, ScaleRule::ocp);
      const std::vector<float> want_values = dequantize(want);
      uint8_t *codes, *scales;
      CUDA_OK(cudaMalloc(&codes, size_t(rows * d)));
      CUDA_OK(cudaMalloc(&scales, size_t(rows * nb)));
      CUDA_OK(cudaMemset(codes, 0xA5, size_t(rows * d)));
      CUDA_OK(cudaMemset(scales, 0xA5, size_t(rows * nb)));
      cuda::quantize_rows(view, ScaleRule::ocp, {f, codes, scales, true, true}, {}, nullptr);
      std::vector<uint8_t> gc(size_t(rows * d)), gs(size_t(rows * nb));
      CUDA_OK(cudaMemcpy(gc.data(), codes, gc.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gs.data(), scales, gs.size(), cudaMemcpyDeviceToHost));
      const Elem fp8 = cuda::mma_elem(f);
      int64_t folded_rows = 0;
      for (int64_t r = 0; r < rows; ++r) {
        bool uniform = true;
        for (int64_t i = 0; i < d; ++i) {
          const float got = decode_elem(fp8, gc[size_t(r * d + i)]) * decode_e8m0(gs[size_t(r * nb + i / 32)]);
          ASSERT_EQ(got, want_values[size_t(r * d + i)]) << format_name(f) << " d=" << d << " row " << r << " elem " << i;
          uniform &= gs[size_t(r * nb + i / 32)] == gs[size_t(r * nb)];
        }
        folded_rows += uniform;
      }
      if (f == Format::mxfp4)
        EXPECT_EQ(folded_rows, rows) << "d=" << d;
      else
        EXPECT_GT(folded_rows, 0) << format_name(f) << " d=" << d;
      std::printf("[fold] %s d=%lld: %lld of %lld rows folded\n", std::string(format_name(f)).c_str(), (long long)d, (long long)folded_rows,
                  (long long)rows);
      cudaFree(codes);
      cudaFree(scales);
    }
    cudaFree(dx);
  }
}

// round_fold (the prefill's MXFP8 forms): every E4M3 / E5M2 row whose block scales span at most 2^8
// folds to its largest scale; a value moves only where its shifted form falls below the FP8 type's
// subnormal step (E4M3 2^-6 x 2^-3, E5M2 2^-14 x 2^-2, in row-scale units), and then by at most half
// that step; rows with a block 2^-10 below the rest keep their scales unless the shift is exact.
TEST(GpuQuantize, RoundFoldMovesOnlySubnormalValuesByHalfAStep) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // Block levels 2^0..2^3 over a per-row level; every 7th row one block at 2^-10.
  auto level = [](int64_t r, int64_t i) { return (r % 7 == 0 && i / 32 == 1 ? -10 : int((i / 32 + r) % 4)) + int(r % 9) - 4; };
  constexpr int64_t rows = 700;
  for (int64_t d : {64, 128, 256}) {
    const int64_t nb = d / 32;
    const std::vector<float> x = leveled_rows(rows, d, uint64_t(7 + d), level);
    HostTensor host = HostTensor::from_floats(x, {1, 1, rows, d}, DType::bf16);
    const std::vector<float> rounded = host.to_floats();
    void* dx;
    CUDA_OK(cudaMalloc(&dx, host.nbytes()));
    CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
    const TensorView view = TensorView::contiguous(dx, DType::bf16, {1, 1, rows, d}, Device::cuda);
    for (Format f : {Format::mxfp8_e4m3, Format::mxfp8_e5m2}) {
      const Quantized want = quantize(rounded.data(), rows, d, f, ScaleRule::ceil);
      const std::vector<float> want_values = dequantize(want);
      const Elem e = cuda::mma_elem(f);
      const double step = e == Elem::e4m3 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -16), normal = e == Elem::e4m3 ? std::ldexp(1.0, -6) : std::ldexp(1.0, -14);
      uint8_t *codes, *scales;
      CUDA_OK(cudaMalloc(&codes, size_t(rows * d)));
      CUDA_OK(cudaMalloc(&scales, size_t(rows * nb)));
      CUDA_OK(cudaMemset(codes, 0xA5, size_t(rows * d)));  // poison
      CUDA_OK(cudaMemset(scales, 0xA5, size_t(rows * nb)));
      cuda::QuantTarget t{f, codes, scales, true, true};
      t.round_fold = true;
      cuda::quantize_rows(view, ScaleRule::ceil, t, {}, nullptr);
      std::vector<uint8_t> gc(size_t(rows * d)), gs(size_t(rows * nb));
      CUDA_OK(cudaMemcpy(gc.data(), codes, gc.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gs.data(), scales, gs.size(), cudaMemcpyDeviceToHost));
      int64_t moved = 0, wide_folded = 0;
      for (int64_t r = 0; r < rows; ++r) {
        int lo = 255, hi = 0;
        bool uniform = true;
        for (int64_t c = 0; c < nb; ++c) {
          lo = std::min<int>(lo, want.scales[size_t(r * nb + c)]);
          hi = std::max<int>(hi, want.scales[size_t(r * nb + c)]);
          uniform &= gs[size_t(r * nb + c)] == gs[size_t(r * nb)];
        }
        const std::string what = std::string(format_name(f)) + " d=" + std::to_string(d) + " row " + std::to_string(r);
        if (hi - lo <= 8) ASSERT_TRUE(uniform) << what;
        if (uniform) ASSERT_EQ(gs[size_t(r * nb)], hi) << what;
        wide_folded += hi - lo > 8 && uniform;
        const double row_scale = decode_e8m0(uint8_t(hi));
        bool row_moved = false;
        for (int64_t i = 0; i < d; ++i) {
          const double got = double(decode_elem(e, gc[size_t(r * d + i)])) * decode_e8m0(gs[size_t(r * nb + i / 32)]);
          const double w = want_values[size_t(r * d + i)], diff = std::fabs(got - w);
          if (diff == 0) continue;
          row_moved = true;
          ASSERT_TRUE(uniform) << what << " elem " << i;  // only a folded row moves a value
          ASSERT_LT(std::fabs(w), normal * row_scale) << what << " elem " << i << ": a normal value moved";
          ASSERT_LE(diff, 0.5 * step * row_scale) << what << " elem " << i;
        }
        moved += row_moved;
        if (hi - lo > 8) ASSERT_FALSE(row_moved) << what << ": a row spanning more than 2^8 moved a value";
      }
      std::printf("[round fold] %s d=%lld: %lld of %lld rows moved a value; %lld rows spanning > 2^8 folded exactly\n",
                  std::string(format_name(f)).c_str(), (long long)d, (long long)moved, (long long)rows, (long long)wide_folded);
      if (f == Format::mxfp8_e4m3) EXPECT_GT(moved, 0) << "d=" << d << ": no row took the rounding fold";
      cudaFree(codes);
      cudaFree(scales);
    }
    cudaFree(dx);
  }
}

// The prefill's pre-pass forms on 16-bit inputs (the pass's (E4M3, E2M1) instance, whose E2M1
// rounds in f16 pairs): Q's (FP8 bytes, folded) and K's (with row scales) keep every value of the
// codec. MXFP4 rows whose block scales span at most 2^8 fold (the shift stays exact); rows holding a
// block 2^-10 below the rest (its 0.5s and 1.5s would fall under E4M3's 2^-9) keep their scales.
TEST(GpuQuantize, PrefillPairFormsKeepValues) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t d : {64, 128, 256}) {
      const int64_t H = 3, N = 200, rows = H * N, nb = d / 32, pad = 256;
      Rng rng(31 + d);
      std::vector<float> x(size_t(rows * d));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < d; ++i) {  // block levels 2^0..2^8 over a per-row level; every 7th row one block at 2^-10
          const int level = r % 7 == 0 && i / 32 == 1 ? -10 : int((i / 32 * 3 + r) % 9);
          x[size_t(r * d + i)] = float(rng.normal() * std::ldexp(1.0, level + int(r % 5) - 2));
        }
      HostTensor host = HostTensor::from_floats(x, {1, H, N, d}, dt);
      const std::vector<float> rounded = host.to_floats();
      void* dx;
      CUDA_OK(cudaMalloc(&dx, host.nbytes()));
      CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
      const TensorView view = TensorView::contiguous(dx, dt, {1, H, N, d}, Device::cuda);
      const Format fmt[2] = {Format::mxfp8_e4m3, Format::mxfp4};
      std::vector<float> want[2];
      std::vector<uint8_t> want_scales[2];
      for (int t = 0; t < 2; ++t) {
        const Quantized q = quantize(rounded.data(), rows, d, fmt[t], ScaleRule::ocp);
        want[t] = dequantize(q);
        want_scales[t] = q.scales;
      }
      for (bool row_scales : {false, true}) {
        uint8_t *codes[2], *scales[2];
        float* rs[2];
        int* uni[2];
        cuda::QuantTarget tg[2];
        const int64_t srows = row_scales ? H * pad : rows;
        for (int t = 0; t < 2; ++t) {
          CUDA_OK(cudaMalloc(&codes[t], size_t(rows * d)));
          CUDA_OK(cudaMalloc(&scales[t], size_t(srows * nb)));
          CUDA_OK(cudaMalloc(&rs[t], size_t(H * pad) * sizeof(float)));
          CUDA_OK(cudaMalloc(&uni[t], size_t(H * 2) * sizeof(int)));
          CUDA_OK(cudaMemset(codes[t], 0xA5, size_t(rows * d)));  // poison
          CUDA_OK(cudaMemset(scales[t], 0xA5, size_t(srows * nb)));
          CUDA_OK(cudaMemset(rs[t], 0, size_t(H * pad) * sizeof(float)));
          CUDA_OK(cudaMemset(uni[t], 0, size_t(H * 2) * sizeof(int)));
          tg[t] = row_scales ? cuda::QuantTarget{fmt[t], codes[t], scales[t], true, true, rs[t], pad, uni[t]}
                             : cuda::QuantTarget{fmt[t], codes[t], scales[t], true, true};
        }
        cuda::quantize_rows(view, ScaleRule::ocp, tg[0], tg[1], nullptr);
        for (int t = 0; t < 2; ++t) {
          std::vector<uint8_t> gc(size_t(rows * d)), gs(size_t(srows * nb));
          std::vector<float> grs(size_t(H * pad));
          CUDA_OK(cudaMemcpy(gc.data(), codes[t], gc.size(), cudaMemcpyDeviceToHost));
          CUDA_OK(cudaMemcpy(gs.data(), scales[t], gs.size(), cudaMemcpyDeviceToHost));
          CUDA_OK(cudaMemcpy(grs.data(), rs[t], grs.size() * sizeof(float), cudaMemcpyDeviceToHost));
          const std::string what = std::string(format_name(fmt[t])) + " " + std::string(dtype_name(dt)) + " d=" +
                                   std::to_string(d) + (row_scales ? " (K form)" : " (Q form)");
          int64_t folded = 0;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t slot = row_scales ? r / N * pad + r % N : r;
            bool uniform = true;
            int lo = 255, hi = 0;
            for (int64_t c = 0; c < nb; ++c) {
              uniform &= gs[size_t(slot * nb + c)] == gs[size_t(slot * nb)];
              lo = std::min<int>(lo, want_scales[t][size_t(r * nb + c)]);
              hi = std::max<int>(hi, want_scales[t][size_t(r * nb + c)]);
            }
            for (int64_t i = 0; i < d; ++i) {
              const float got = decode_elem(Elem::e4m3, gc[size_t(r * d + i)]) * decode_e8m0(gs[size_t(slot * nb + i / 32)]);
              ASSERT_EQ(got, want[t][size_t(r * d + i)]) << what << " row " << r << " elem " << i;
            }
            if (row_scales) ASSERT_EQ(grs[size_t(slot)], uniform ? decode_e8m0(gs[size_t(slot * nb)]) : -1.0f) << what << " row " << r;
            if (fmt[t] == Format::mxfp4 && hi - lo <= 8) ASSERT_TRUE(uniform) << what << " row " << r;
            if (fmt[t] == Format::mxfp4 && r % 7 == 0) ASSERT_FALSE(uniform) << what << " row " << r;
            folded += uniform;
          }
          std::printf("[pair fold] %s: %lld of %lld rows folded\n", what.c_str(), (long long)folded, (long long)rows);
          cudaFree(codes[t]);
          cudaFree(scales[t]);
          cudaFree(rs[t]);
          cudaFree(uni[t]);
        }
      }
      cudaFree(dx);
    }
}

// fold_key_tiles after the pre-pass: values unchanged (every element's FP8 byte x its block scale is
// the codec's value), a folded tile's keys all carry its scale, MXFP4 tiles whose key scales span at
// most 2^8 fold, and a tile holding one key 2^-12 below the others (its E2M1 values would fall under
// E4M3's smallest subnormal) does not. Outputs poisoned first; ragged last tile (N = 300).
TEST(GpuQuantize, KeyTileFoldingKeepsValues) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (int64_t d : {64, 128, 256}) {
    const int64_t BH = 2, N = 300, pad = 384, nb = d / 32, tiles = pad / 128;
    Rng rng(7 + d);
    std::vector<float> x(size_t(BH * N * d));
    for (int64_t r = 0; r < BH * N; ++r) {
      const int64_t key = r % N;
      // Tile 0: key levels 2^0..2^5; tile 1: the same, with key 200 at 2^-12; tile 2: levels 2^0..2^2.
      const int level = key == 200 ? -12 : key < 256 ? int(key % 6) : int(key % 3);
      for (int64_t i = 0; i < d; ++i) x[size_t(r * d + i)] = float(rng.normal() * std::ldexp(1.0, level));
    }
    HostTensor host = HostTensor::from_floats(x, {1, BH, N, d}, DType::f32);
    void* dx;
    CUDA_OK(cudaMalloc(&dx, host.nbytes()));
    CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
    const TensorView view = TensorView::contiguous(dx, DType::f32, {1, BH, N, d}, Device::cuda);
    for (Format f : {Format::mxfp4, Format::mxfp8_e4m3}) {
      const std::vector<float> want = dequantize(quantize(x.data(), BH * N, d, f, ScaleRule::ocp));
      uint8_t *codes, *scales;
      float *rs, *ts;
      int* uni;
      CUDA_OK(cudaMalloc(&codes, size_t(BH * N * d)));
      CUDA_OK(cudaMalloc(&scales, size_t(BH * pad * nb)));
      CUDA_OK(cudaMalloc(&rs, size_t(BH * pad) * sizeof(float)));
      CUDA_OK(cudaMalloc(&ts, size_t(BH * tiles) * sizeof(float)));
      CUDA_OK(cudaMalloc(&uni, size_t(BH * tiles) * sizeof(int)));
      CUDA_OK(cudaMemset(codes, 0xA5, size_t(BH * N * d)));
      CUDA_OK(cudaMemset(rs, 0, size_t(BH * pad) * sizeof(float)));
      CUDA_OK(cudaMemset(ts, 0xA5, size_t(BH * tiles) * sizeof(float)));  // poison: a negative value no tile gets
      CUDA_OK(cudaMemset(uni, 0, size_t(BH * tiles) * sizeof(int)));
      cuda::quantize_rows(view, ScaleRule::ocp, {f, codes, scales, true, true, rs, pad, uni}, {}, nullptr);
      const cuda::KeyFold fold{codes, scales, rs, uni, ts, false};
      cuda::fold_key_tiles(&fold, 1, BH, N, pad, d, nullptr);
      std::vector<uint8_t> gc(size_t(BH * N * d)), gs(size_t(BH * pad * nb));
      std::vector<float> grs(size_t(BH * pad)), gts(size_t(BH * tiles));
      CUDA_OK(cudaMemcpy(gc.data(), codes, gc.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gs.data(), scales, gs.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(grs.data(), rs, grs.size() * sizeof(float), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gts.data(), ts, gts.size() * sizeof(float), cudaMemcpyDeviceToHost));
      std::vector<int> guni(size_t(BH * tiles));
      CUDA_OK(cudaMemcpy(guni.data(), uni, guni.size() * sizeof(int), cudaMemcpyDeviceToHost));
      if (f == Format::mxfp8_e4m3) {  // Gaussian rows at d >= 64: some key's E4M3 blocks keep different scales
        bool any_split = false;
        for (int v : guni) any_split |= v != 0;
        EXPECT_TRUE(any_split) << "d=" << d << ": the test data should exercise a non-uniform tile";
      }
      for (int64_t bh = 0; bh < BH; ++bh) {
        for (int64_t key = 0; key < N; ++key) {
          const int64_t r = bh * N + key, slot = bh * pad + key;
          for (int64_t i = 0; i < d; ++i) {
            const float got = decode_elem(Elem::e4m3, gc[size_t(r * d + i)]) * decode_e8m0(gs[size_t(slot * nb + i / 32)]);
            ASSERT_EQ(got, want[size_t(r * d + i)]) << format_name(f) << " d=" << d << " key " << r << " elem " << i;
          }
          const float tile_scale = gts[size_t(bh * tiles + key / 128)];
          // -1 exactly where some key of the tile keeps several scales (the kernel's per-block path).
          ASSERT_EQ(tile_scale < 0.0f, guni[size_t(bh * tiles + key / 128)] != 0) << format_name(f) << " key " << r;
          ASSERT_TRUE(tile_scale == -1.0f || tile_scale == 0.0f || tile_scale == grs[size_t(slot)]) << format_name(f) << " key " << r;
        }
        std::printf("[tile fold] %s d=%lld head %lld: tile scales %g %g %g\n", std::string(format_name(f)).c_str(),
                    (long long)d, (long long)bh, gts[size_t(bh * tiles)], gts[size_t(bh * tiles + 1)], gts[size_t(bh * tiles + 2)]);
        if (f == Format::mxfp4) {
          EXPECT_GT(gts[size_t(bh * tiles)], 0.0f) << "d=" << d;      // levels 2^0..2^5
          EXPECT_EQ(gts[size_t(bh * tiles + 1)], 0.0f) << "d=" << d;  // one key at 2^-12
          EXPECT_GT(gts[size_t(bh * tiles + 2)], 0.0f) << "d=" << d;  // the ragged last tile
        }
      }
      cudaFree(codes);
      cudaFree(scales);
      cudaFree(rs);
      cudaFree(ts);
      cudaFree(uni);
    }
    cudaFree(dx);
  }
}

// NVFP4 (quantize_rows_nvfp4) against the CPU codec on each row, bit for bit: each row is NVFP4 under
// its own second scale (the codec's tensor scale of that row alone): the E4M3 block scales in the
// padded row layout, each value (E2M1 times its block scale, bf16), the rows' second scales, the tiles
// marked "a scale a key" (0); strided rows of each dtype, rows of magnitudes 2^-14 .. 2^14, one slice
// all zeros (second scale 1), outputs poisoned.
TEST(GpuQuantize, Nvfp4MatchesCpuCodecBitForBit) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t B = 2, H = 3, N = 200, d = 64, dpad = 80, pad = 256, BH = B * H;
  Rng rng(99);
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<float> vals(size_t(BH * N * dpad));
    for (size_t i = 0; i < vals.size(); ++i)
      vals[i] = i / size_t(N * dpad) == 4 ? 0.0f : float(rng.normal() * std::ldexp(1.0, int(i / dpad % 29) - 14));
    const HostTensor host = HostTensor::from_floats(vals, {B, H, N, dpad}, dt);
    const std::vector<float> rounded = host.to_floats();
    void* dx;
    CUDA_OK(cudaMalloc(&dx, host.nbytes()));
    CUDA_OK(cudaMemcpy(dx, host.bytes(), host.nbytes(), cudaMemcpyHostToDevice));
    TensorView view = TensorView::contiguous(dx, dt, {B, H, N, dpad}, Device::cuda);
    view.shape[3] = d;
    uint16_t* codes;
    uint8_t* scales;
    float *ts, *tiles;
    int* flag;
    CUDA_OK(cudaMalloc(&codes, size_t(BH * N * d) * 2));
    CUDA_OK(cudaMalloc(&scales, size_t(BH * pad * d / 16)));
    CUDA_OK(cudaMalloc(&ts, size_t(BH * pad) * 4));
    CUDA_OK(cudaMalloc(&tiles, size_t(BH * pad / 128) * 4));
    CUDA_OK(cudaMalloc(&flag, 4));
    CUDA_OK(cudaMemset(codes, 0xA5, size_t(BH * N * d) * 2));  // poison
    CUDA_OK(cudaMemset(scales, 0xA5, size_t(BH * pad * d / 16)));
    CUDA_OK(cudaMemset(ts, 0xA5, size_t(BH * pad) * 4));
    CUDA_OK(cudaMemset(tiles, 0xA5, size_t(BH * pad / 128) * 4));
    CUDA_OK(cudaMemset(flag, 0, 4));
    cuda::quantize_rows_nvfp4(view, {codes, scales, pad, ts, tiles}, nullptr, flag);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> gc(size_t(BH * N * d));
    std::vector<uint8_t> gs(size_t(BH * pad * d / 16));
    std::vector<float> gts(size_t(BH * pad)), gtiles(size_t(BH * pad / 128));
    int gflag = -1;
    CUDA_OK(cudaMemcpy(gc.data(), codes, gc.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gs.data(), scales, gs.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gts.data(), ts, gts.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gtiles.data(), tiles, gtiles.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&gflag, flag, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(gflag, 0) << dtype_name(dt);
    for (int64_t s = 0; s < BH; ++s) {
      for (int64_t n = 0; n < N; ++n) {
        const float* row = rounded.data() + (s * N + n) * dpad;
        const Quantized want = quantize(row, 1, d, Format::nvfp4, ScaleRule::ocp);
        ASSERT_EQ(gts[size_t(s * pad + n)], want.tensor_scale) << dtype_name(dt) << " slice " << s << " row " << n;
        if (s == 4) ASSERT_EQ(gts[size_t(s * pad + n)], 1.0f) << "an all-zero row";
        for (int64_t i = 0; i < d; ++i) {
          const uint8_t code = element_code(want.codes.data(), i, true);
          const float value = decode_elem(Elem::e2m1, code) * decode_elem(Elem::e4m3, want.scales[size_t(i / 16)]);
          const uint16_t got = gc[size_t((s * N + n) * d + i)];
          ASSERT_EQ(to_float(bf16{got}), value) << dtype_name(dt) << " slice " << s << " row " << n << " col " << i;
          ASSERT_EQ(got >> 15, code >> 3) << "sign, " << dtype_name(dt) << " slice " << s << " row " << n << " col " << i;
        }
        for (int64_t c = 0; c < d / 16; ++c)
          ASSERT_EQ(gs[size_t((s * pad + n) * (d / 16) + c)], want.scales[size_t(c)])
              << dtype_name(dt) << " slice " << s << " row " << n << " block " << c;
      }
      for (int64_t tile = 0; tile < (N + 127) / 128; ++tile) EXPECT_EQ(gtiles[size_t(s * (pad / 128) + tile)], 0.0f);
    }
    // A NaN raises the flag.
    const float nan = std::nanf("");
    const HostTensor one = HostTensor::from_floats({nan}, {1, 1, 1, 1}, dt);
    CUDA_OK(cudaMemcpy(static_cast<uint8_t*>(dx) + dtype_size(dt) * 7, one.bytes(), dtype_size(dt), cudaMemcpyHostToDevice));
    cuda::quantize_rows_nvfp4(view, {codes, scales, pad, ts, tiles}, nullptr, flag);
    CUDA_OK(cudaMemcpy(&gflag, flag, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(gflag, 1) << dtype_name(dt);
    for (void* p : {dx, static_cast<void*>(codes), static_cast<void*>(scales), static_cast<void*>(ts),
                    static_cast<void*>(tiles), static_cast<void*>(flag)})
      cudaFree(p);
  }
}
