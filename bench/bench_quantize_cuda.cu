// GPU quantize pass (one read of a bf16 [B,H,N,d] tensor, MXFP8 E4M3 + MXFP4 written) against a
// device-to-device copy of the same tensor, both timed with CUDA events in the same run.
// Bandwidth counts bytes read + bytes written.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda/prepass/quantize.hpp"

using namespace dmattn;

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));        \
      return 1;                                                            \
    }                                                                      \
  } while (0)

template <class F>
float time_ms(F f, int iters) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  f();  // warm-up
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms / iters;
}

int main() {
  const int64_t B = 1, H = 8, N = 65536, d = 128, elems = B * H * N * d;
  void *x, *copy;
  uint8_t *c8, *s8, *c4, *s4;
  CK(cudaMalloc(&x, elems * 2));
  CK(cudaMalloc(&copy, elems * 2));
  CK(cudaMalloc(&c8, elems));
  CK(cudaMalloc(&c4, elems / 2));
  CK(cudaMalloc(&s8, elems / 32));
  CK(cudaMalloc(&s4, elems / 32));
  std::vector<uint16_t> h(static_cast<size_t>(elems));
  // Signed values of a bell-shaped spread (a sum of four hashed uniforms), as activations are: the
  // blocks of a row take different scales, so the fold does the work it does on real Q and K.
  for (int64_t i = 0; i < elems; ++i) {
    float x = -2.0f;
    for (uint32_t j = 0; j < 4; ++j) x += float((uint32_t(i) * 2654435761u + j * 40503u) * 2246822519u >> 8) * 0x1p-24f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    h[size_t(i)] = uint16_t((bits + 0x8000u) >> 16);  // to bf16, rounded
  }
  CK(cudaMemcpy(x, h.data(), elems * 2, cudaMemcpyHostToDevice));
  const TensorView v = TensorView::contiguous(x, DType::bf16, {B, H, N, d}, Device::cuda);
  const int iters = 50;
  const float copy_ms = time_ms([&] { cudaMemcpyAsync(copy, x, elems * 2, cudaMemcpyDeviceToDevice); }, iters);
  const float q2_ms = time_ms(
      [&] { cuda::quantize_rows(v, ScaleRule::ocp, {Format::mxfp8_e4m3, c8, s8}, {Format::mxfp4, c4, s4}, nullptr); },
      iters);
  const float q1_ms = time_ms([&] { cuda::quantize_rows(v, ScaleRule::ocp, {Format::mxfp4, c4, s4}, {}, nullptr); }, iters);
  // The attention pre-pass's form of K: both formats as FP8 bytes, scales folded where exact, per-row
  // scales and per-tile fold flags (src/cuda/prefill/attention.cu).
  uint8_t *f8, *f4;
  float *r8, *r4;
  int *u8, *u4;
  const int64_t rows = B * H * N;
  CK(cudaMalloc(&f8, elems));
  CK(cudaMalloc(&f4, elems));
  CK(cudaMalloc(&r8, rows * 4));
  CK(cudaMalloc(&r4, rows * 4));
  CK(cudaMalloc(&u8, rows / 128 * 4));
  CK(cudaMalloc(&u4, rows / 128 * 4));
  CK(cudaMemset(u8, 0, rows / 128 * 4));
  CK(cudaMemset(u4, 0, rows / 128 * 4));
  const float qp_ms = time_ms(
      [&] {
        cuda::quantize_rows(v, ScaleRule::ocp, {Format::mxfp8_e4m3, f8, s8, true, true, r8, N, u8},
                            {Format::mxfp4, f4, s4, true, true, r4, N, u4}, nullptr);
      },
      iters);
  // Q's pre-pass form: both formats as FP8 bytes, folded, no row scales.
  const float qq_ms = time_ms(
      [&] {
        cuda::quantize_rows(v, ScaleRule::ocp, {Format::mxfp8_e4m3, f8, s8, true, true},
                            {Format::mxfp4, f4, s4, true, true}, nullptr);
      },
      iters);
  // The default policy's Q form (ceil rule, MXFP8 rows folded with rounding), without and with the
  // rotation applied as rows are read (RowTransform): the difference is what the rotation costs.
  cuda::QuantTarget rq8{Format::mxfp8_e4m3, f8, s8, true, true}, rq4{Format::mxfp4, f4, s4, true, true};
  rq8.round_fold = rq4.round_fold = true;
  const float qd_ms = time_ms([&] { cuda::quantize_rows(v, ScaleRule::ceil, rq8, rq4, nullptr); }, iters);
  const float qr_ms = time_ms(
      [&] { cuda::quantize_rows(v, ScaleRule::ceil, rq8, rq4, nullptr, nullptr, {true, true, nullptr}); }, iters);
  CK(cudaDeviceSynchronize());
  // Bytes each kernel moves (read + written), and a row of the table from them.
  const double copy_bytes = 2.0 * elems * 2, copy_gbs = copy_bytes / (copy_ms * 1e6);
  const double q2_bytes = elems * 2 + elems + elems / 2 + 2 * elems / 32, q1_bytes = elems * 2 + elems / 2 + elems / 32;
  const double qp_bytes = elems * 2 + 2 * elems + 2 * elems / 32 + 2 * rows * 4;
  const double qq_bytes = elems * 2 + 2 * elems + 2 * elems / 32;
  auto row = [&](const char* name, float ms, double bytes) {
    const double gbs = bytes / (ms * 1e6);
    std::printf("%-34s %9.4f %9.1f %7.1f%%\n", name, ms, gbs, 100 * gbs / copy_gbs);
  };
  std::printf("quantize bench: bf16 [%lld,%lld,%lld,%lld] (%.0f MiB)\n", (long long)B, (long long)H, (long long)N,
              (long long)d, elems * 2 / 1048576.0);
  std::printf("%-34s %9s %9s %8s\n", "kernel", "ms", "GB/s", "of copy");
  row("device copy (baseline)", copy_ms, copy_bytes);
  row("quantize mxfp8-e4m3 + mxfp4", q2_ms, q2_bytes);
  row("quantize mxfp4", q1_ms, q1_bytes);
  row("pre-pass K (fp8 bytes, folded)", qp_ms, qp_bytes);
  row("pre-pass Q (fp8 bytes, folded)", qq_ms, qq_bytes);
  row("pre-pass Q, ceil, round_fold", qd_ms, qq_bytes);
  row("the same, rotated (default)", qr_ms, qq_bytes);
  return 0;
}
