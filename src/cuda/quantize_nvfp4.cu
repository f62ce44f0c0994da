// NVFP4 for the prefill (quantize.hpp, Nvfp4Target): the codec's own block encoder on the device, so
// the codes are the CPU's by construction. NVFP4 is not the default policy's format: these two
// launches are written to be plainly right, not tuned like quantize.cu's MX pass.
#include <string>
#include <type_traits>

#include "cuda/buffers.hpp"
#include "cuda/quantize.hpp"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int kThreads = 256, kPer = 8;  // amax: eight consecutive elements (one row's) a thread

// Each (b, h) slice's largest |x| as float bits (non-negative floats order like their bits; NaN and
// Inf sit above every finite value, so a non-finite slice shows as amax >= Inf's bits).
template <class T>
__global__ void slice_amax_kernel(const T* x, Shape shape, Shape stride, uint32_t* amax, int* nonfinite) {
  const int64_t bh = blockIdx.y, d = shape[3], e0 = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kPer;
  uint32_t m = 0;
  if (e0 < shape[2] * d) {
    const T* row = x + (bh / shape[1]) * stride[0] + (bh % shape[1]) * stride[1] + (e0 / d) * stride[2] + e0 % d;
#pragma unroll
    for (int i = 0; i < kPer; ++i) m = max(m, __float_as_uint(to_float(row[i])) & 0x7FFFFFFFu);
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if (threadIdx.x % 32 == 0 && m != 0) {
    atomicMax(amax + bh, m);
    if (m >= 0x7F800000u && nonfinite) atomicOr(nonfinite, 1);
  }
}

// One 16-block a thread: the codec's quantize_nvfp4_block under the slice's tensor scale, each E2M1
// value times its block's E4M3 scale stored as bf16 (exact: at most 2 x 4 significant bits).
template <class T>
__global__ void nvfp4_blocks_kernel(const T* x, Shape shape, Shape stride, Nvfp4Target t) {
  const int64_t nb = shape[3] / kNvfp4Block, blk = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (blk >= shape[0] * shape[1] * shape[2] * nb) return;
  const int64_t row = blk / nb, c = blk % nb, n = row % shape[2], bh = row / shape[2];
  const T* src = x + (bh / shape[1]) * stride[0] + (bh % shape[1]) * stride[1] + n * stride[2] + c * kNvfp4Block;
  float v[kNvfp4Block];
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) v[i] = to_float(src[i]);
  const float ts = nvfp4_tensor_scale(__uint_as_float(t.amax[bh]));
  uint8_t codes[kNvfp4Block];
  const uint8_t sc = quantize_nvfp4_block(v, kNvfp4Block, ts, codes);
  const float bs = decode_elem(Elem::e4m3, sc);
  uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) w[i / 2] |= uint32_t(to_bf16(decode_elem(Elem::e2m1, codes[i]) * bs).bits) << (16 * (i % 2));
  uint4* dst = reinterpret_cast<uint4*>(t.values) + 2 * blk;
  dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
  dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  if (t.scales) t.scales[(bh * t.row_pad + n) * nb + c] = sc;
  if (c == 0 && n == 0) t.tensor_scale[bh] = ts;
  if (c == 0 && n % 128 == 0 && t.tile_scale) t.tile_scale[bh * (t.row_pad / 128) + n / 128] = ts;
}

}  // namespace

void quantize_rows_nvfp4(const TensorView& x, const Nvfp4Target& t, cudaStream_t stream, int* nonfinite) {
  if (x.device != Device::cuda) throw Error("quantize_rows_nvfp4: the tensor is not on a CUDA device");
  if (x.shape[3] % kNvfp4Block != 0 || x.stride[3] != 1)
    throw Error("quantize_rows_nvfp4: d must be a multiple of 16, with unit stride");
  if (!t.values || !t.tensor_scale || !t.amax || t.row_pad < x.shape[2] || (t.tile_scale && t.row_pad % 128 != 0))
    throw Error("quantize_rows_nvfp4: missing output buffers, row_pad below N, or tile scales with row_pad not a multiple of 128");
  if (reinterpret_cast<uintptr_t>(t.values) % 16 != 0) throw Error("quantize_rows_nvfp4: values must be 16-byte aligned");
  const int64_t bh = x.shape[0] * x.shape[1], elems = x.shape[2] * x.shape[3];
  if (bh == 0 || elems == 0) return;
  if (bh > 65535) throw Error("quantize_rows_nvfp4: more than 65535 (batch, head) slices");
  check(cudaMemsetAsync(t.amax, 0, size_t(bh) * sizeof(uint32_t), stream), "cudaMemset");
  const int64_t blocks = bh * x.shape[2] * (x.shape[3] / kNvfp4Block);
  with_typed(x, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const dim3 grid(unsigned((elems + kThreads * kPer - 1) / (kThreads * kPer)), unsigned(bh));
    slice_amax_kernel<T><<<grid, kThreads, 0, stream>>>(typed, x.shape, x.stride, t.amax, nonfinite);
    nvfp4_blocks_kernel<T><<<unsigned((blocks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(typed, x.shape, x.stride, t);
  });
  check(cudaGetLastError(), "nvfp4 quantize kernels");
}

}  // namespace dmattn::cuda
