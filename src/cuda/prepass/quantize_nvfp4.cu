// NVFP4 for the prefill (quantize.hpp, Nvfp4Target): the codec's own block encoder on the device, so
// the codes are the CPU's by construction. NVFP4 is not the default policy's format: this launch is
// written to be plainly right, not tuned like quantize.cu's MX pass.
#include <string>
#include <type_traits>

#include "cuda/common/buffers.hpp"
#include "cuda/prepass/quantize.hpp"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int kThreads = 256;

// One 16-block a thread, a row's nb = d/16 blocks in nb consecutive lanes of one warp (32 % nb == 0):
// the row's amax by a shuffle reduction over those lanes, its second scale nvfp4_tensor_scale(amax),
// then the codec's quantize_nvfp4_block under it, each E2M1 value times its block's E4M3 scale stored
// as bf16 (exact: at most 2 x 4 significant bits).
template <class T>
__global__ void nvfp4_rows_kernel(const T* x, Shape shape, Shape stride, Nvfp4Target t, int* nonfinite) {
  const int nb = int(shape[3] / kNvfp4Block);
  const int64_t blk = int64_t(blockIdx.x) * kThreads + threadIdx.x, total = shape[0] * shape[1] * shape[2] * nb;
  const bool live = blk < total;
  const int64_t row = live ? blk / nb : 0, c = blk % nb, n = row % shape[2], bh = row / shape[2];
  float v[kNvfp4Block];
  float amax = 0.0f;
  if (live) {
    const T* src = x + (bh / shape[1]) * stride[0] + (bh % shape[1]) * stride[1] + n * stride[2] + c * kNvfp4Block;
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) {
      v[i] = to_float(src[i]);
      amax = fmaxf(amax, fabsf(v[i]));  // NaN drops out here; it is flagged below
    }
  }
  bool bad = false;
#pragma unroll
  for (int i = 0; i < kNvfp4Block; ++i) bad |= live && !hd::is_finite(v[i]);
  if (bad && nonfinite) atomicOr(nonfinite, 1);
  for (int o = nb / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!live) return;
  const float ts = nvfp4_tensor_scale(amax);
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
  if (c == 0) t.row_scale[bh * t.row_pad + n] = ts;
  if (c == 0 && n % 128 == 0 && t.tile_scale) t.tile_scale[bh * (t.row_pad / 128) + n / 128] = 0.0f;  // a scale a key
}

}  // namespace

void quantize_rows_nvfp4(const TensorView& x, const Nvfp4Target& t, cudaStream_t stream, int* nonfinite) {
  if (x.device != Device::cuda) throw Error("quantize_rows_nvfp4: the tensor is not on a CUDA device");
  const int64_t nb = x.shape[3] / kNvfp4Block;
  if (x.shape[3] % kNvfp4Block != 0 || x.stride[3] != 1 || nb < 1 || 32 % nb != 0)
    throw Error("quantize_rows_nvfp4: d must be 16 x a power of two up to 512, with unit stride");
  if (!t.values || !t.row_scale || t.row_pad < x.shape[2] || (t.tile_scale && t.row_pad % 128 != 0))
    throw Error("quantize_rows_nvfp4: missing output buffers, row_pad below N, or tile scales with row_pad not a multiple of 128");
  if (reinterpret_cast<uintptr_t>(t.values) % 16 != 0) throw Error("quantize_rows_nvfp4: values must be 16-byte aligned");
  const int64_t blocks = x.shape[0] * x.shape[1] * x.shape[2] * nb;
  if (blocks == 0) return;
  with_typed(x, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    nvfp4_rows_kernel<T><<<unsigned((blocks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(typed, x.shape, x.stride, t,
                                                                                                 nonfinite);
  });
  check(cudaGetLastError(), "nvfp4 quantize kernel");
}

}  // namespace dmattn::cuda
