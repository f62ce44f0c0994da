// The codec header compiled for the device gives the same codes and values as on the host.
// Skips (visibly) where no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test.hpp"

#include <vector>

#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

constexpr int kBlocks = 4096;  // Elem(0..4) are the five element formats

// Per element format: decode of all 256 codes, encode of every input, one MX block per 32 inputs
// under each scale rule, and bf16/fp16 rounding of every input.
__global__ void codec_kernel(const float* in, int n, float* decoded, uint8_t* encoded, uint8_t* block_codes,
                             uint8_t* block_scales, uint16_t* halfs) {
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  for (int e = 0; e < 5; ++e) {
    if (tid < 256) decoded[e * 256 + tid] = decode_elem(Elem(e), uint8_t(tid));
    if (tid < n) encoded[e * n + tid] = encode_elem(Elem(e), in[tid]);
    for (int r = 0; r < 2; ++r)
      if (tid < n / 32)
        block_scales[(e * 2 + r) * (n / 32) + tid] = quantize_mx_block(in + tid * 32, 32, Elem(e), ScaleRule(r),
                                                                       block_codes + (size_t(e * 2 + r) * n) + tid * 32);
  }
  if (tid < n) {
    halfs[2 * tid] = to_bf16(in[tid]).bits;
    halfs[2 * tid + 1] = to_fp16(in[tid]).bits;
  }
}


}  // namespace

TEST(GpuCodec, DeviceMatchesHostBitForBit) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const int n = kBlocks * 32;
  std::vector<float> in(n);
  Rng rng(99);
  for (int i = 0; i < n; ++i) in[i] = float(rng.normal() * std::ldexp(1.0, int(rng.next_u64() % 40) - 20));
  in[7] = 0.0f;  // a few specials
  in[8] = -0.0f;
  in[9] = 1e-40f;
  float *d_in, *d_dec;
  uint8_t *d_enc, *d_bc, *d_bs;
  uint16_t* d_h;
  CUDA_OK(cudaMalloc(&d_in, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_dec, 5 * 256 * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_enc, 5 * n));
  CUDA_OK(cudaMalloc(&d_bc, 10 * size_t(n)));
  CUDA_OK(cudaMalloc(&d_bs, 10 * (n / 32)));
  CUDA_OK(cudaMalloc(&d_h, 2 * n * sizeof(uint16_t)));
  CUDA_OK(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(d_enc, 0xAB, 5 * n));  // poison
  codec_kernel<<<(n + 255) / 256, 256>>>(d_in, n, d_dec, d_enc, d_bc, d_bs, d_h);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> dec(5 * 256);
  std::vector<uint8_t> enc(5 * n), bc(10 * size_t(n)), bs(10 * (n / 32));
  std::vector<uint16_t> h(2 * n);
  CUDA_OK(cudaMemcpy(dec.data(), d_dec, dec.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(enc.data(), d_enc, enc.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(bc.data(), d_bc, bc.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(bs.data(), d_bs, bs.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(h.data(), d_h, h.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  for (int e = 0; e < 5; ++e) {
    for (int c = 0; c < 256; ++c) {
      const float want = decode_elem(Elem(e), uint8_t(c));
      if (want != want)
        EXPECT_NE(dec[e * 256 + c], dec[e * 256 + c]);
      else
        EXPECT_EQ(dec[e * 256 + c], want) << e << " " << c;
    }
    for (int i = 0; i < n; ++i) ASSERT_EQ(enc[e * n + i], encode_elem(Elem(e), in[i])) << e << " " << in[i];
    for (int r = 0; r < 2; ++r)
      for (int b = 0; b < n / 32; ++b) {
        uint8_t codes[32];
        ASSERT_EQ(bs[(e * 2 + r) * (n / 32) + b], quantize_mx_block(in.data() + b * 32, 32, Elem(e), ScaleRule(r), codes));
        for (int i = 0; i < 32; ++i) ASSERT_EQ(bc[size_t(e * 2 + r) * n + b * 32 + i], codes[i]);
      }
  }
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(h[2 * i], to_bf16(in[i]).bits);
    ASSERT_EQ(h[2 * i + 1], to_fp16(in[i]).bits);
  }
  cudaFree(d_in);
  cudaFree(d_dec);
  cudaFree(d_enc);
  cudaFree(d_bc);
  cudaFree(d_bs);
  cudaFree(d_h);
}
