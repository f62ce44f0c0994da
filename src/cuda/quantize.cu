#include "cuda/quantize.hpp"

#include <string>
#include <type_traits>

#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int kBlock = 32;

struct Geometry {
  int64_t H, N, nblk;            // heads, rows per head, 32-blocks per row
  int64_t sb, sh, sn;            // element strides of b, h, n
};

// Four lanes share one 32-block, eight consecutive elements each, so a warp reads and writes
// contiguous memory (coalesced); the block's amax and NaN flag are combined with quad shuffles, and
// the scale and codes come from the same codec calls as on the CPU (quantize_mx_block's rule).
constexpr int kPerLane = 8;

// Index is uint32_t whenever the tensor is small enough: 64-bit division costs the GPU far more
// than the quantization itself.
template <class T, bool kVector, class Index>
__global__ void quantize_rows_kernel(const T* __restrict__ x, Geometry g, int64_t nblocks, ScaleRule rule,
                                     QuantTarget t0, QuantTarget t1, Elem e0, Elem e1, int targets) {
  const Index lane_id = Index(blockIdx.x) * blockDim.x + threadIdx.x;
  const Index blk = lane_id / 4;
  const int part = int(lane_id % 4);
  const bool active = blk < Index(nblocks);  // inactive lanes still take part in the shuffles
  const Index nblk = Index(g.nblk), N = Index(g.N), H = Index(g.H);
  const Index row = active ? blk / nblk : 0, c = active ? blk % nblk : 0;
  const Index n = row % N, bh = row / N, h = bh % H, b = bh / H;
  const T* src = x + int64_t(b) * g.sb + int64_t(h) * g.sh + int64_t(n) * g.sn + int64_t(c) * kBlock + part * kPerLane;
  float v[kPerLane];
  float amax = 0.0f;
  bool bad = false;
  alignas(16) T raw[kPerLane];
  if constexpr (kVector) {  // 16-byte loads where the rows are 16-byte aligned
    static_assert(sizeof(raw) % 16 == 0);
#pragma unroll
    for (int i = 0; i < int(sizeof(raw) / 16); ++i)
      reinterpret_cast<uint4*>(raw)[i] = active ? reinterpret_cast<const uint4*>(src)[i] : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if constexpr (kVector)
      v[i] = to_float(raw[i]);
    else
      v[i] = active ? to_float(src[i]) : 0.0f;
    bad |= !hd::is_finite(v[i]);
    amax = fmaxf(amax, hd::abs_f(v[i]));
  }
#pragma unroll
  for (int s = 1; s < 4; s <<= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
    bad |= __shfl_xor_sync(0xffffffffu, int(bad), s) != 0;
  }
  const int64_t d = g.nblk * kBlock;
  const int row_lanes = int(g.nblk) * 4;  // the lanes holding one row (a power of two when folding)
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    if (t >= targets) break;
    const QuantTarget& q = t == 0 ? t0 : t1;
    const Elem e = t == 0 ? e0 : e1;
    uint8_t sc = bad ? kE8M0NaN : choose_e8m0(amax, e, rule);
    const int xexp = int(sc) - 127;
    const ElemSpec spec = elem_spec(e);
    const Elem to = e == Elem::e5m2 ? Elem::e5m2 : Elem::e4m3;
    uint8_t codes[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      codes[i] = sc == kE8M0NaN ? uint8_t(0) : encode_elem(spec, hd::ldexp2(v[i], -xexp));
      if (q.fp8_bytes) codes[i] = encode_elem(to, decode_elem(e, codes[i]));
    }
    if (q.fold) {  // uniform across the grid: every lane takes part in the shuffles
      int smax = sc;
      for (int s = 4; s < row_lanes; s <<= 1) smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, s));
      const int k = int(sc) - smax;  // <= 0: this block's codes shift down by 2^k
      uint8_t folded[kPerLane];
      bool exact = !bad && smax != kE8M0NaN;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const float value = decode_elem(to, codes[i]);
        // FP8 values are >= 2^-16 in magnitude, so a shift below 2^-24 cannot stay representable.
        const float shifted = k >= -24 ? hd::ldexp2(value, k) : 0.0f;
        folded[i] = encode_elem(to, shifted);
        exact &= value == 0.0f || (k >= -24 && decode_elem(to, folded[i]) == shifted);
      }
      for (int s = 1; s < row_lanes; s <<= 1) exact &= __shfl_xor_sync(0xffffffffu, int(exact), s) != 0;
      if (exact) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) codes[i] = folded[i];
        sc = uint8_t(smax);
      }
    }
    if (active) {
      const int64_t first = int64_t(row) * d + int64_t(c) * kBlock + part * kPerLane;  // element index of codes[0]
      if (e == Elem::e2m1 && !q.fp8_bytes) {
        uint32_t w = 0;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) w |= uint32_t(codes[i]) << (4 * i);
        *reinterpret_cast<uint32_t*>(q.codes + first / 2) = w;
      } else {
        uint2 w;
        uint8_t* wb = reinterpret_cast<uint8_t*>(&w);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) wb[i] = codes[i];
        *reinterpret_cast<uint2*>(q.codes + first) = w;
      }
      // With row scales, the block scales take the same padded row layout: [B*H][row_pad][d/32].
      if (part == 0) q.scales[q.row_scale ? (int64_t(bh) * q.row_pad + n) * g.nblk + c : int64_t(blk)] = sc;
    }
    if (q.row_scale) {  // uniform across the grid, like q.fold
      int smin = sc, smax = sc;
      for (int s = 4; s < row_lanes; s <<= 1) {
        smin = min(smin, __shfl_xor_sync(0xffffffffu, smin, s));
        smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, s));
      }
      if (active && part == 0 && c == 0) {
        const bool uniform = smin == smax && smax != kE8M0NaN;
        q.row_scale[int64_t(bh) * q.row_pad + n] = uniform ? decode_e8m0(uint8_t(smax)) : -1.0f;
        if (!uniform) atomicAnd(q.tile_uniform + int64_t(bh) * (q.row_pad / 128) + n / 128, 0);
      }
    }
  }
}

}  // namespace

void quantize_rows(const TensorView& x, ScaleRule rule, const QuantTarget& first, const QuantTarget& second,
                   cudaStream_t stream) {
  if (x.device != Device::cuda) throw Error("quantize_rows: the tensor is not on a CUDA device");
  if (x.shape[3] % kBlock != 0) throw Error("quantize_rows: d must be a multiple of 32");
  if (x.stride[3] != 1) throw Error("quantize_rows: the last axis must have unit stride");
  const int targets = second.codes ? 2 : 1;
  // Folding and row scales combine a row's blocks with lane shuffles: d/32 a power of two <= 8.
  const int64_t nblk = x.shape[3] / kBlock;
  const bool row_in_lanes = (nblk & (nblk - 1)) == 0 && nblk <= 8;
  for (const QuantTarget* t : {&first, &second}) {
    if (t == &second && targets == 1) break;
    const FormatInfo fi = format_info(t->format);
    if (!fi.has_codes || fi.block != kBlock)
      throw Error("quantize_rows: format " + std::string(fi.name) + " is not an MX 32-block format");
    if (!t->codes || !t->scales) throw Error("quantize_rows: missing output buffers");
    if (t->row_scale && (!t->tile_uniform || t->row_pad < x.shape[2] || t->row_pad % 128 != 0 || !row_in_lanes))
      throw Error("quantize_rows: row scales need tile flags, row_pad >= N (a multiple of 128) and d/32 a power of two <= 8");
    if (t->fold && (!t->fp8_bytes || !row_in_lanes))
      throw Error("quantize_rows: folding needs the FP8-byte form and d/32 a power of two <= 8");
  }
  Geometry g{x.shape[1], x.shape[2], nblk, x.stride[0], x.stride[1], x.stride[2]};
  const int64_t nblocks = x.shape[0] * x.shape[1] * x.shape[2] * g.nblk;
  if (nblocks == 0) return;
  const int threads = 256;
  const unsigned grid = unsigned((nblocks * 4 + threads - 1) / threads);
  const Elem e0 = format_info(first.format).elem, e1 = targets == 2 ? format_info(second.format).elem : e0;
  const size_t es = dtype_size(x.dtype);
  const bool vec = reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && (g.sb * es) % 16 == 0 && (g.sh * es) % 16 == 0 &&
                   (g.sn * es) % 16 == 0;
  with_typed(x, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const bool small = nblocks * 4 + threads < (int64_t(1) << 32);
    if (vec && small)
      quantize_rows_kernel<T, true, uint32_t><<<grid, threads, 0, stream>>>(typed, g, nblocks, rule, first, second, e0, e1, targets);
    else if (small)
      quantize_rows_kernel<T, false, uint32_t><<<grid, threads, 0, stream>>>(typed, g, nblocks, rule, first, second, e0, e1, targets);
    else
      quantize_rows_kernel<T, false, int64_t><<<grid, threads, 0, stream>>>(typed, g, nblocks, rule, first, second, e0, e1, targets);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("quantize_rows: launch failed: ") + cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
