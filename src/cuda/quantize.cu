#include "cuda/quantize.hpp"

#include <string>
#include <type_traits>

#include "cuda/fp8.cuh"
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
// contiguous memory (coalesced); the block's amax and NaN flag are combined with quad shuffles.
constexpr int kPerLane = 8;

// The storage code of a scaled value (the codec's encode_elem: FP8 by the hardware conversion,
// E2M1 by its midpoint count, FP6 by the generic rounding), and the FP8 byte holding a code's value
// (E5M2 for E5M2, E4M3 for every other element). Compile-time element types keep the per-element
// work to a few instructions: the runtime spec of the generic codec cost ~5x the memory time.
template <Elem E>
__device__ __forceinline__ uint8_t elem_code(float s) {
  if constexpr (E == Elem::e4m3 || E == Elem::e5m2)
    return fp8_encode<E == Elem::e5m2>(s);
  else if constexpr (E == Elem::e2m1)
    return encode_e2m1(s);
  else
    return encode_elem(elem_spec(E), s);
}

template <Elem E>
__device__ __forceinline__ uint8_t fp8_byte(uint8_t code) {
  if constexpr (E == Elem::e4m3 || E == Elem::e5m2) {
    return code;
  } else if constexpr (E == Elem::e2m1) {
    // E2M1 magnitudes 0, 0.5, then 2^((m>>1)-1) * (1 + (m&1)/2): E4M3 exponent field (m>>1)+6,
    // mantissa (m&1)<<2.
    const int m = code & 7;
    const int mag = m == 0 ? 0 : m == 1 ? 0x30 : (((m >> 1) + 6) << 3) | ((m & 1) << 2);
    return uint8_t(((code & 8) << 4) | mag);
  } else {
    return fp8_encode<false>(decode_elem(E, code));
  }
}

struct Lanes {  // where this lane's eight elements sit
  uint32_t row, c, n, bh;
  int part;
  bool active;
  int row_lanes;  // the lanes holding one row (a power of two when folding or with row scales)
  int64_t nblk;
};

// One target: scale, codes (optionally as FP8 bytes, folded), stores, row-scale flags.
template <Elem E>
__device__ __forceinline__ void emit(const QuantTarget& q, ScaleRule rule, const float (&v)[kPerLane], float amax,
                                     bool bad, const Lanes& l) {
  constexpr bool kE5M2 = E == Elem::e5m2;
  uint8_t sc = bad ? kE8M0NaN : choose_e8m0(amax, E, rule);
  // 2^-X as one factor (2^-127 is subnormal but exact): a product by a power of two rounds once,
  // exactly like the codec's ldexp.
  const float inv = hd::ldexp2(1.0f, 127 - int(sc));
  uint8_t codes[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    codes[i] = sc == kE8M0NaN ? uint8_t(0) : elem_code<E>(v[i] * inv);
    if (q.fp8_bytes) codes[i] = fp8_byte<E>(codes[i]);
  }
  if (q.fold) {  // uniform across the grid: every lane takes part in the shuffles
    int smax = sc;
    for (int s = 4; s < l.row_lanes; s <<= 1) smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, s));
    const int k = int(sc) - smax;  // <= 0: this block's values shift down by 2^k
    // FP8 values are >= 2^-16 in magnitude, so a shift below 2^-24 cannot stay representable.
    const float shift = k >= -24 ? hd::ldexp2(1.0f, k) : 0.0f;
    uint8_t folded[kPerLane];
    bool exact = !bad && smax != kE8M0NaN;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float value = fp8_decode<kE5M2>(codes[i]);
      const float shifted = value * shift;
      folded[i] = fp8_encode<kE5M2>(shifted);
      exact &= value == 0.0f || (k >= -24 && fp8_decode<kE5M2>(folded[i]) == shifted);
    }
    for (int s = 1; s < l.row_lanes; s <<= 1) exact &= __shfl_xor_sync(0xffffffffu, int(exact), s) != 0;
    if (exact) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) codes[i] = folded[i];
      sc = uint8_t(smax);
    }
  }
  if (l.active) {
    const int64_t d = l.nblk * kBlock;
    const int64_t first = int64_t(l.row) * d + int64_t(l.c) * kBlock + l.part * kPerLane;  // element index of codes[0]
    if (E == Elem::e2m1 && !q.fp8_bytes) {
      uint32_t w = 0;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) w |= uint32_t(codes[i]) << (4 * i);
      *reinterpret_cast<uint32_t*>(q.codes + first / 2) = w;
    } else {
      uint2 w;
      w.x = uint32_t(codes[0]) | uint32_t(codes[1]) << 8 | uint32_t(codes[2]) << 16 | uint32_t(codes[3]) << 24;
      w.y = uint32_t(codes[4]) | uint32_t(codes[5]) << 8 | uint32_t(codes[6]) << 16 | uint32_t(codes[7]) << 24;
      *reinterpret_cast<uint2*>(q.codes + first) = w;
    }
    // With row scales, the block scales take the same padded row layout: [B*H][row_pad][d/32].
    if (l.part == 0)
      q.scales[q.row_scale ? (int64_t(l.bh) * q.row_pad + l.n) * l.nblk + l.c : int64_t(l.row) * l.nblk + l.c] = sc;
  }
  if (q.row_scale) {  // uniform across the grid, like q.fold
    int smin = sc, smax = sc;
    for (int s = 4; s < l.row_lanes; s <<= 1) {
      smin = min(smin, __shfl_xor_sync(0xffffffffu, smin, s));
      smax = max(smax, __shfl_xor_sync(0xffffffffu, smax, s));
    }
    if (l.active && l.part == 0 && l.c == 0) {
      const bool uniform = smin == smax && smax != kE8M0NaN;
      q.row_scale[int64_t(l.bh) * q.row_pad + l.n] = uniform ? decode_e8m0(uint8_t(smax)) : -1.0f;
      if (!uniform) atomicAnd(q.tile_uniform + int64_t(l.bh) * (q.row_pad / 128) + l.n / 128, 0);
    }
  }
}

template <class F>
__device__ __forceinline__ void with_elem(Elem e, F&& f) {
  switch (e) {
    case Elem::e4m3: f(std::integral_constant<Elem, Elem::e4m3>{}); break;
    case Elem::e5m2: f(std::integral_constant<Elem, Elem::e5m2>{}); break;
    case Elem::e3m2: f(std::integral_constant<Elem, Elem::e3m2>{}); break;
    case Elem::e2m3: f(std::integral_constant<Elem, Elem::e2m3>{}); break;
    case Elem::e2m1: f(std::integral_constant<Elem, Elem::e2m1>{}); break;
  }
}

// Each thread quantizes kUnits lane-units a grid apart, all loads issued before any arithmetic, so
// enough bytes are in flight to cover DRAM latency at this kernel's occupancy (~54 registers).
constexpr int kUnits = 2;

// 32-bit indices: 64-bit division costs the GPU far more than the quantization itself.
template <class T, bool kVector>
__global__ void __launch_bounds__(256) quantize_rows_kernel(const T* __restrict__ x, Geometry g, uint32_t nblocks,
                                                            ScaleRule rule, QuantTarget t0, QuantTarget t1, Elem e0,
                                                            Elem e1, int targets, int* nonfinite) {
  const uint32_t nblk = uint32_t(g.nblk), N = uint32_t(g.N), H = uint32_t(g.H);
  Lanes l[kUnits];
  alignas(16) T raw[kUnits][kPerLane];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const uint32_t lane_id = (blockIdx.x + u * gridDim.x) * blockDim.x + threadIdx.x;
    const uint32_t blk = lane_id / 4;
    l[u].part = int(lane_id % 4);
    l[u].active = blk < nblocks;  // inactive lanes still take part in the shuffles
    l[u].nblk = g.nblk;
    l[u].row_lanes = int(g.nblk) * 4;
    l[u].row = l[u].active ? blk / nblk : 0;
    l[u].c = l[u].active ? blk % nblk : 0;
    l[u].n = l[u].row % N;
    l[u].bh = l[u].row / N;
    const uint32_t h = l[u].bh % H, b = l[u].bh / H;
    const T* src =
        x + int64_t(b) * g.sb + int64_t(h) * g.sh + int64_t(l[u].n) * g.sn + int64_t(l[u].c) * kBlock + l[u].part * kPerLane;
    if constexpr (kVector) {  // 16-byte loads where the rows are 16-byte aligned
      static_assert(sizeof(raw[u]) % 16 == 0);
#pragma unroll
      for (int i = 0; i < int(sizeof(raw[u]) / 16); ++i)
        reinterpret_cast<uint4*>(raw[u])[i] =
            l[u].active ? __ldg(reinterpret_cast<const uint4*>(src) + i) : make_uint4(0, 0, 0, 0);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) raw[u][i] = l[u].active ? src[i] : T{};
    }
  }
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    float v[kPerLane];
    float amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      v[i] = to_float(raw[u][i]);
      bad |= !hd::is_finite(v[i]);
      amax = fmaxf(amax, hd::abs_f(v[i]));
    }
#pragma unroll
    for (int s = 1; s < 4; s <<= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
      bad |= __shfl_xor_sync(0xffffffffu, int(bad), s) != 0;
    }
    if (bad && nonfinite && l[u].part == 0) atomicOr(nonfinite, 1);
    with_elem(e0, [&](auto e) { emit<decltype(e)::value>(t0, rule, v, amax, bad, l[u]); });
    if (targets == 2) with_elem(e1, [&](auto e) { emit<decltype(e)::value>(t1, rule, v, amax, bad, l[u]); });
  }
}

}  // namespace

void quantize_rows(const TensorView& x, ScaleRule rule, const QuantTarget& first, const QuantTarget& second,
                   cudaStream_t stream, int* nonfinite) {
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
  const unsigned grid = unsigned((nblocks * 4 + threads * kUnits - 1) / (threads * kUnits));
  const Elem e0 = format_info(first.format).elem, e1 = targets == 2 ? format_info(second.format).elem : e0;
  const size_t es = dtype_size(x.dtype);
  const bool vec = reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && (g.sb * es) % 16 == 0 && (g.sh * es) % 16 == 0 &&
                   (g.sn * es) % 16 == 0;
  // A tensor this large (2^35 elements) cannot sit on one GPU next to its quantized copies.
  if (nblocks * 4 + threads * kUnits >= (int64_t(1) << 32)) throw Error("quantize_rows: tensor too large (2^35 elements or more)");
  with_typed(x, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    if (vec)
      quantize_rows_kernel<T, true><<<grid, threads, 0, stream>>>(typed, g, uint32_t(nblocks), rule, first, second, e0, e1,
                                                                  targets, nonfinite);
    else
      quantize_rows_kernel<T, false><<<grid, threads, 0, stream>>>(typed, g, uint32_t(nblocks), rule, first, second, e0, e1,
                                                                   targets, nonfinite);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("quantize_rows: launch failed: ") + cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
