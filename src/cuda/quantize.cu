#include "cuda/quantize.hpp"

#include <string>

#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int kBlock = 32;

template <class T>
__device__ __forceinline__ float load_as_float(const T* p, int i);
template <>
__device__ __forceinline__ float load_as_float(const float* p, int i) { return p[i]; }
template <>
__device__ __forceinline__ float load_as_float(const fp16* p, int i) { return to_float(p[i]); }
template <>
__device__ __forceinline__ float load_as_float(const bf16* p, int i) { return to_float(p[i]); }

struct Geometry {
  int64_t H, N, nblk;            // heads, rows per head, 32-blocks per row
  int64_t sb, sh, sn;            // element strides of b, h, n
};

// Writes one block's codes: E2M1 as 16 packed bytes, wider formats as 32 bytes, in 16-byte stores.
__device__ __forceinline__ void store_codes(const uint8_t* codes, bool packed, uint8_t* dst) {
  if (packed) {
    uint4 w;
    uint8_t* b = reinterpret_cast<uint8_t*>(&w);
#pragma unroll
    for (int i = 0; i < 16; ++i) b[i] = uint8_t(codes[2 * i] | (codes[2 * i + 1] << 4));
    *reinterpret_cast<uint4*>(dst) = w;
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(codes);
    reinterpret_cast<uint4*>(dst)[0] = src[0];
    reinterpret_cast<uint4*>(dst)[1] = src[1];
  }
}

// One thread per 32-element block: load, quantize to each target, store.
template <class T>
__global__ void quantize_rows_kernel(const T* __restrict__ x, Geometry g, int64_t nblocks, ScaleRule rule,
                                     QuantTarget t0, QuantTarget t1, Elem e0, Elem e1, int targets) {
  const int64_t blk = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (blk >= nblocks) return;
  const int64_t row = blk / g.nblk, c = blk % g.nblk;
  const int64_t n = row % g.N, bh = row / g.N, h = bh % g.H, b = bh / g.H;
  const T* src = x + b * g.sb + h * g.sh + n * g.sn + c * kBlock;
  float v[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) v[i] = load_as_float(src, i);
  alignas(16) uint8_t codes[kBlock];
  const int64_t d = g.nblk * kBlock;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    if (t >= targets) break;
    const QuantTarget& q = t == 0 ? t0 : t1;
    const Elem e = t == 0 ? e0 : e1;
    const uint8_t sc = quantize_mx_block(v, kBlock, e, rule, codes);
    if (q.fp8_bytes) {
      const Elem to = e == Elem::e5m2 ? Elem::e5m2 : Elem::e4m3;
#pragma unroll
      for (int i = 0; i < kBlock; ++i) codes[i] = encode_elem(to, decode_elem(e, codes[i]));
    }
    const bool packed = e == Elem::e2m1 && !q.fp8_bytes;
    store_codes(codes, packed, q.codes + (packed ? row * d / 2 + c * kBlock / 2 : row * d + c * kBlock));
    q.scales[blk] = sc;
  }
}

}  // namespace

void quantize_rows(const TensorView& x, ScaleRule rule, const QuantTarget& first, const QuantTarget& second,
                   cudaStream_t stream) {
  if (x.device != Device::cuda) throw Error("quantize_rows: the tensor is not on a CUDA device");
  if (x.shape[3] % kBlock != 0) throw Error("quantize_rows: d must be a multiple of 32");
  if (x.stride[3] != 1) throw Error("quantize_rows: the last axis must have unit stride");
  const int targets = second.codes ? 2 : 1;
  for (const QuantTarget* t : {&first, &second}) {
    if (t == &second && targets == 1) break;
    const FormatInfo fi = format_info(t->format);
    if (!fi.has_codes || fi.block != kBlock)
      throw Error("quantize_rows: format " + std::string(fi.name) + " is not an MX 32-block format");
    if (!t->codes || !t->scales) throw Error("quantize_rows: missing output buffers");
  }
  Geometry g{x.shape[1], x.shape[2], x.shape[3] / kBlock, x.stride[0], x.stride[1], x.stride[2]};
  const int64_t nblocks = x.shape[0] * x.shape[1] * x.shape[2] * g.nblk;
  if (nblocks == 0) return;
  const int threads = 128;
  const unsigned grid = unsigned((nblocks + threads - 1) / threads);
  const Elem e0 = format_info(first.format).elem, e1 = targets == 2 ? format_info(second.format).elem : e0;
  switch (x.dtype) {
    case DType::f32:
      quantize_rows_kernel<<<grid, threads, 0, stream>>>(static_cast<const float*>(x.data), g, nblocks, rule, first,
                                                         second, e0, e1, targets);
      break;
    case DType::f16:
      quantize_rows_kernel<<<grid, threads, 0, stream>>>(static_cast<const fp16*>(x.data), g, nblocks, rule, first,
                                                         second, e0, e1, targets);
      break;
    case DType::bf16:
      quantize_rows_kernel<<<grid, threads, 0, stream>>>(static_cast<const bf16*>(x.data), g, nblocks, rule, first,
                                                         second, e0, e1, targets);
      break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("quantize_rows: launch failed: ") + cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
