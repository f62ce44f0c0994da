#include "cuda/prepass/quantize.hpp"

#include <string>
#include <type_traits>

#include "cuda/common/head_dims.hpp"
#include "cuda/ptx/mma.cuh"
#include "cuda/prepass/quantize_block.cuh"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/policy.hpp"
#include "dmattn/rotation.hpp"

namespace dmattn::cuda {
namespace {

constexpr int kBlock = 32;

// x / d for 32-bit x by one 64-bit high product: m = ceil(2^64 / d) makes the product's error below
// 1/d for every x < 2^32 (x = q d + r: x m / 2^64 = q + r/d + x eps/(d 2^64), eps < d), so the
// floor is exact. A runtime 32-bit division costs ~20 instructions; the pass did three per lane.
// A power of two divides by a shift (the usual d/32 and often N and H).
struct FastDiv {
  uint64_t m = 0;
  int shift = 0;  // >= 0: the divisor is 2^shift (1 included); else m
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor)
      : m(divisor > 1 ? ~uint64_t(0) / divisor + 1 : 0), shift((divisor & (divisor - 1)) == 0 ? __builtin_ctz(divisor) : -1) {}
  __device__ __forceinline__ uint32_t div(uint32_t x) const {
    return shift >= 0 ? x >> shift : uint32_t(__umul64hi(x, m));
  }
};

struct Geometry {
  int64_t H, N, nblk;            // heads, rows per head, 32-blocks per row
  int64_t sb, sh, sn;            // element strides of b, h, n
  FastDiv by_H, by_N, by_nblk;
  bool packed;                   // rows back to back (sn = d, sh = N sn, sb = H sh): element offset = lane * 8
};

// Where a lane's kPerLane elements sit. Four lanes share one 32-block, so a warp reads and writes
// contiguous memory (coalesced); the block's amax and NaN flag are combined with quad shuffles. The
// outputs are dense rows ([rows, d] codes, [rows, d/32] scales), so a lane's codes start at element
// lane * 8 and its block's scale sits at blk: only the source address of a strided input and the row
// scales need the block's (b, h, n), whose divisions are skipped otherwise.
struct Lanes {
  uint32_t lane, blk;  // lane-unit index, 32-block index (lane / 4)
  uint32_t n, bh, c;   // the block's row within its head, its b * H + h and its column block (when needed)
  int part;
  bool active;
};

// A target's form: read from the QuantTarget at run time (RuntimeForm), or fixed at compile time
// (FixedForm: the plain codes, and the prefill pre-pass's two forms, FP8 bytes folded, K's with row
// scales), with the row's lane count: the encoder then runs without branches on the flags and its
// shuffle loops unroll. kUnits: the lane-units a thread takes (quantize_rows_kernel). Four for the
// plain forms (measured: the pair at 88% of copy against 86% with two); two where the encoder holds
// more (the run-time form spills with four; the pre-pass's K form ran 4% slower with four).
// kSlots: K's form for packed sequences (PackedRows), an instance of its own so the batch's keep
// their code.
struct RuntimeForm {
  static constexpr bool kFixed = false, kBytes = false, kRows = false, kSlots = false;
  static constexpr int kRowLanes = 0, kUnits = 2;
};
template <bool kFp8BytesFolded, bool kRowScales, int kLanes, int kUnits_, bool kSlots_ = false>
struct FixedForm {
  static constexpr bool kFixed = true, kBytes = kFp8BytesFolded, kRows = kRowScales, kSlots = kSlots_;
  static constexpr int kRowLanes = kLanes, kUnits = kUnits_;
};
using PlainForm = FixedForm<false, false, 0, 4>;
template <bool kRowScales, int kLanes, bool kSlots = false>
using PrefillForm = FixedForm<true, kRowScales, kLanes, 2, kSlots>;

// The targets' element types: chosen at run time by a switch per target, or fixed at compile time (one
// E2M1 target, or the (E4M3, E2M1) pair of the prefill pre-pass and of DMA's two formats), so the
// encoders inline into one straight line the scheduler can interleave.
enum class Elems { runtime, e2m1, e4m3_e2m1 };

// One target: scale, codes (optionally as FP8 bytes, folded), stores, row-scale flags.
template <Elem E, bool kHalf, class F>
__device__ __forceinline__ void emit(const QuantTarget& q, ScaleRule rule, const float (&v)[kPerLane], float amax,
                                     bool bad, const Lanes& l, int nblk, const PackedRows& pr) {
  const bool fp8_bytes = F::kFixed ? F::kBytes : q.fp8_bytes, fold = F::kFixed ? F::kBytes : q.fold;
  const bool round_fold = fold && q.round_fold;
  const bool rows = F::kFixed ? F::kRows : q.row_scale != nullptr;
  const int row_lanes = F::kFixed ? F::kRowLanes : nblk * 4;
  uint2 w;
  uint32_t row_max;
  const uint32_t sc = encode_lane<E, kHalf>(rule, v, amax, bad, fp8_bytes, fold, round_fold, row_lanes, w, row_max);
  // With row scales, the row's place in the padded rows (kSlots: the codes' too); active lanes only.
  auto prow = [&] { return int64_t(l.bh) * q.row_pad + (F::kSlots ? int64_t(pr.slot[l.n]) : int64_t(l.n)); };
  if (l.active) {
    const int64_t at = F::kSlots ? prow() * nblk * 4 + l.c * 4 + l.part : int64_t(l.lane);
    if (E == Elem::e2m1 && !fp8_bytes)
      reinterpret_cast<uint32_t*>(q.codes)[at] = w.x;
    else
      reinterpret_cast<uint2*>(q.codes)[at] = w;
    // With row scales, the block scales take the padded row layout: [B*H][row_pad][d/32].
    if (l.part == 0) q.scales[rows ? prow() * nblk + l.c : int64_t(l.blk)] = uint8_t(sc);
  }
  if (rows) {  // uniform across the grid, like fold
    // With fold, the row's largest code before the fold: every block has it now exactly where all agree.
    const bool equal = row_scales_equal(sc, row_lanes, fold ? int(row_max) : -1);
    if (l.active && l.part == 0 && l.c == 0) {
      const bool uniform = equal && sc != kE8M0NaN;
      q.row_scale[prow()] = uniform ? decode_e8m0(sc) : -1.0f;
      if (!uniform)  // every writer writes 1
        q.tile_split[F::kSlots ? prow() / 128 : int64_t(l.bh) * (q.row_pad / 128) + l.n / 128] = 1;
    }
  }
}

// To bf16, round to nearest even (cvt), and back.
__device__ __forceinline__ void round_to_bf16(float (&v)[kPerLane]) {
#pragma unroll
  for (int e = 0; e < kPerLane; e += 2) {
    const uint32_t pair = bf16x2_rn(v[e], v[e + 1]);
    v[e] = __uint_as_float(pair << 16);
    v[e + 1] = __uint_as_float(pair & 0xFFFF0000u);
  }
}

// RowTransform on one lane-unit (kPerLane channels 8 u.. of its row, u = its unit in the row; a
// row's units sit in consecutive lanes of the warp, 4 nblk of them from a multiple of 4 nblk): the
// butterfly's stages below 8 channels in registers, the rest across lanes, in the oracle's order.
// kRowLanes: the row's lane count where the form fixes it (a power of two, so d is one and the
// rotation block is d): the unit is then the thread index's low bits (a CTA's lane-units, and the
// grid's stride between a thread's units, are multiples of kRowLanes), so a thread's units share
// their signs, and the lane stages unroll, where a run-time row length needs a division and a
// counted loop.
// kKeep: w takes the rows rotated but not less sub (RowTransform::sub_first's second target).
template <int kRowLanes, bool kSeq, bool kKeep>
__device__ __forceinline__ void transform_unit(float (&v)[kPerLane], float (&w)[kPerLane], const Lanes& l,
                                               uint32_t nblk, int d, const RowTransform& tf, const PackedRows& pr) {
  static_assert((kRowLanes & (kRowLanes - 1)) == 0);
  const int unit = kRowLanes ? int(threadIdx.x % kRowLanes) : int(4 * (l.blk % nblk)) + l.part, ch0 = kPerLane * unit;
  if (tf.rotate) {
    const int blk = kRowLanes ? kPerLane * kRowLanes : rotation_block(d);
    // The signs flip sign bits (a product by -1, exactly, in one logic op an element).
    const uint32_t signs = rotation_sign_bits(unit);  // channels ch0 = 8 unit ..
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] = __uint_as_float(__float_as_uint(v[e]) ^ ((signs << (31 - e)) & 0x80000000u));
#pragma unroll
    for (int h = 1; h < kPerLane; h *= 2)
#pragma unroll
      for (int e = 0; e < kPerLane; ++e)
        if (!(e & h) && h < blk) {
          const float a = v[e], c = v[e + h];
          v[e] = a + c;
          v[e + h] = a - c;
        }
#pragma unroll
    for (int m = 1; kPerLane * m < blk; m *= 2) {  // partner lanes m apart: channels 8 m apart
      const float sign = unit & m ? -1.0f : 1.0f;  // the upper of a pair takes other - v: one exact FMA
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) v[e] = fmaf(v[e], sign, __shfl_xor_sync(0xffffffffu, v[e], m));
    }
  }
  if constexpr (kKeep)
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) w[e] = v[e];
  if (tf.sub) {
    const int64_t row = kSeq ? int64_t(pr.seq[l.n]) * pr.heads + l.bh : int64_t(l.bh);
    const float4* s4 = reinterpret_cast<const float4*>(tf.sub + row * d + ch0);
    const float4 a = __ldg(s4), b = __ldg(s4 + 1);
    const float sub[kPerLane] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] -= sub[e];
  }
  round_to_bf16(v);
  if constexpr (kKeep) round_to_bf16(w);
}

// A lane's values as floats: bf16 pairs by one shift or one mask each (to_float's 16-bit path costs a
// permute and a multiply for each odd element).
template <class T>
__device__ __forceinline__ void to_floats(const T (&raw)[kPerLane], float (&v)[kPerLane]) {
  if constexpr (std::is_same_v<T, bf16>) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
#pragma unroll
    for (int i = 0; i < kPerLane / 2; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] = to_float(raw[i]);
  }
}

// Each thread quantizes F::kUnits lane-units a grid apart, all loads issued before any arithmetic, so
// enough bytes are in flight to cover DRAM latency.
// 32-bit indices: 64-bit division costs the GPU far more than the quantization itself.
// F: the targets' form (fixed element types only; RuntimeForm otherwise).
constexpr int kThreads = 256;
// kTf: 0 no RowTransform, 1 one for both targets, 2 its sub for the first target alone.
template <class T, bool kVector, Elems kElems, class F = RuntimeForm, int kTf = 0>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const T* __restrict__ x, Geometry g, uint32_t nblocks,
                                                            ScaleRule rule, QuantTarget t0, QuantTarget t1, Elem e0,
                                                            Elem e1, int targets, int* nonfinite, RowTransform tf,
                                                            PackedRows pr) {
  constexpr int kUnits = F::kUnits;
  static_assert(F::kRowLanes == 0 || kThreads % F::kRowLanes == 0, "transform_unit takes a row's unit from threadIdx");
  const uint32_t nblk = uint32_t(g.nblk), N = uint32_t(g.N), H = uint32_t(g.H);  // as FastDiv in g
  Lanes l[kUnits];
  alignas(16) T raw[kUnits][kPerLane];
  // Row-scale targets (or the run-time form, which may have them) need each block's (n, bh, c).
  const bool where = !g.packed || F::kRows || !F::kFixed || (kTf && tf.sub);
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const uint32_t lane = (blockIdx.x + u * gridDim.x) * blockDim.x + threadIdx.x;
    l[u].lane = lane;
    l[u].blk = lane / 4;
    l[u].part = int(lane % 4);
    l[u].active = l[u].blk < nblocks;  // inactive lanes still take part in the shuffles
    l[u].n = l[u].bh = l[u].c = 0;
    if (where && l[u].active) {
      const uint32_t row = g.by_nblk.div(l[u].blk);
      l[u].c = l[u].blk - row * nblk;
      l[u].bh = g.by_N.div(row);
      l[u].n = row - l[u].bh * N;
    }
    const T* src;
    if (g.packed) {
      src = x + int64_t(lane) * kPerLane;
    } else {
      const uint32_t b = g.by_H.div(l[u].bh), h = l[u].bh - b * H;
      src = x + int64_t(b) * g.sb + int64_t(h) * g.sh + int64_t(l[u].n) * g.sn + int64_t(l[u].c) * kBlock + l[u].part * kPerLane;
    }
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
    float v[kPerLane], w[kPerLane];  // w: the second target's values where they differ (kTf == 2)
    to_floats(raw[u], v);
    if constexpr (kTf) transform_unit<F::kRowLanes, F::kSlots, kTf == 2>(v, w, l[u], nblk, int(nblk) * kBlock, tf, pr);
    float amax, amax1;
    bool bad, bad1;
    block_stats(v, amax, bad);
    if constexpr (kTf == 2) {
      block_stats(w, amax1, bad1);
    } else {
      amax1 = amax;
      bad1 = bad;
    }
    const float(&v1)[kPerLane] = kTf == 2 ? w : v;
    if ((bad || bad1) && nonfinite && l[u].part == 0) atomicOr(nonfinite, 1);
    constexpr bool kHalf = sizeof(T) == 2;  // bf16 / fp16: E2M1 rounds in f16 pairs
    if constexpr (kElems == Elems::e4m3_e2m1) {
      emit<Elem::e4m3, kHalf, F>(t0, rule, v, amax, bad, l[u], int(nblk), pr);
      emit<Elem::e2m1, kHalf, F>(t1, rule, v1, amax1, bad1, l[u], int(nblk), pr);
    } else if constexpr (kElems == Elems::e2m1) {
      emit<Elem::e2m1, kHalf, F>(t0, rule, v, amax, bad, l[u], int(nblk), pr);
    } else {
      with_elem(e0, [&](auto e) { emit<decltype(e)::value, kHalf, F>(t0, rule, v, amax, bad, l[u], int(nblk), pr); });
      if (targets == 2)
        with_elem(e1, [&](auto e) { emit<decltype(e)::value, kHalf, F>(t1, rule, v1, amax1, bad1, l[u], int(nblk), pr); });
    }
  }
}

// What every instance of quantize_rows_kernel is launched with.
struct Launch {
  Geometry g;
  int64_t nblocks;
  ScaleRule rule;
  QuantTarget t0, t1;
  Elem e0, e1;
  int targets;
  int* nonfinite;
  cudaStream_t stream;
  RowTransform tf;
  PackedRows pr;
};

// One instance, its grid sized by its form's units a thread.
template <class T, bool kVector, Elems kElems, class F = RuntimeForm>
void launch(const T* x, const Launch& a) {
  constexpr int64_t per_cta = int64_t(kThreads) * F::kUnits;
  // The kernel's 32-bit lane indices: a tensor this large (2^35 elements) cannot sit on one GPU next to
  // its quantized copies anyway.
  if (a.nblocks * 4 + per_cta >= (int64_t(1) << 32)) throw Error("quantize_rows: tensor too large (2^35 elements or more)");
  const unsigned grid = unsigned((a.nblocks * 4 + per_cta - 1) / per_cta);
  if (a.tf.on && a.tf.sub_first && a.targets == 2) {  // (instances of their own: the plain pass keeps its code)
    if constexpr (!F::kSlots && kElems != Elems::e2m1)  // (K's packed rows and one-target forms never split)
      quantize_rows_kernel<T, kVector, kElems, F, 2><<<grid, kThreads, 0, a.stream>>>(
          x, a.g, uint32_t(a.nblocks), a.rule, a.t0, a.t1, a.e0, a.e1, a.targets, a.nonfinite, a.tf, a.pr);
  } else if (a.tf.on) {
    quantize_rows_kernel<T, kVector, kElems, F, 1><<<grid, kThreads, 0, a.stream>>>(
        x, a.g, uint32_t(a.nblocks), a.rule, a.t0, a.t1, a.e0, a.e1, a.targets, a.nonfinite, a.tf, a.pr);
  } else
    quantize_rows_kernel<T, kVector, kElems, F><<<grid, kThreads, 0, a.stream>>>(x, a.g, uint32_t(a.nblocks), a.rule, a.t0, a.t1,
                                                                                a.e0, a.e1, a.targets, a.nonfinite, a.tf, a.pr);
}

}  // namespace

void quantize_rows(const TensorView& x, ScaleRule rule, const QuantTarget& first, const QuantTarget& second,
                   cudaStream_t stream, int* nonfinite, const RowTransform& transform, const PackedRows& packed) {
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
    if (t->row_scale && (!t->tile_split || t->row_pad < x.shape[2] || t->row_pad % 128 != 0 || !row_in_lanes))
      throw Error("quantize_rows: row scales need tile flags, row_pad >= N (a multiple of 128) and d/32 a power of two <= 8");
    if (t->fold && (!t->fp8_bytes || !row_in_lanes))
      throw Error("quantize_rows: folding needs the FP8-byte form and d/32 a power of two <= 8");
  }
  Geometry g{x.shape[1], x.shape[2], nblk, x.stride[0], x.stride[1], x.stride[2], FastDiv(uint32_t(x.shape[1])),
             FastDiv(uint32_t(x.shape[2])), FastDiv(uint32_t(nblk)),
             x.stride[2] == x.shape[3] && x.stride[1] == x.shape[2] * x.stride[2] && x.stride[0] == x.shape[1] * x.stride[1]};
  const int64_t nblocks = x.shape[0] * x.shape[1] * x.shape[2] * g.nblk;
  if (nblocks == 0) return;
  const Elem e0 = format_info(first.format).elem, e1 = targets == 2 ? format_info(second.format).elem : e0;
  const bool vec = rows_16byte_aligned(x);
  const bool pair = vec && targets == 2 && e0 == Elem::e4m3 && e1 == Elem::e2m1;
  // The prefill pre-pass's forms, both targets alike, d = 64, 128 or 256: compiled for (see PrefillForm).
  const bool rows = first.row_scale != nullptr;
  const bool prefill_form = pair && first.fp8_bytes && first.fold && second.fp8_bytes && second.fold &&
                            rows == (second.row_scale != nullptr) && (nblk == 2 || nblk == 4 || nblk == 8);
  if ((packed.slot || packed.seq) && (!packed.slot || !packed.seq || packed.heads != x.shape[1] || !prefill_form ||
                                      !rows || dtype_size(x.dtype) != 2))
    throw Error("quantize_rows: row slots (and each row's mean) take the prefill's K form: the MXFP8-E4M3 and MXFP4 "
                "pair with row scales, from 16-bit rows, d = 64, 128 or 256");
  auto plain = [](const QuantTarget& t) { return !t.fp8_bytes && !t.fold && !t.row_scale; };
  const bool plain_pair = pair && plain(first) && plain(second);
  const bool plain_e2m1 = vec && targets == 1 && e0 == Elem::e2m1 && plain(first);
  if (transform.sub_first && (targets != 2 || packed.slot))
    throw Error("quantize_rows: a mean for the first target alone takes two targets and unpacked rows");
  if (transform.rotate && (rotation_block(int(x.shape[3])) < kPerLane || x.shape[3] > 256))
    throw Error("quantize_rows: the rotation takes head dims up to 256 with blocks of at least 8");
  const Launch a{g, nblocks, rule, first, second, e0, e1, targets, nonfinite, stream, transform, packed};
  with_typed(x, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    constexpr Elems kPair = Elems::e4m3_e2m1;
    if constexpr (sizeof(T) == 2) {  // (bf16 / fp16: the prefill's inputs)
      if (prefill_form) {
        auto form = [&](auto lanes) {  // a row's lanes: d / 8
          constexpr int kLanes = decltype(lanes)::value;
          if (packed.slot)
            launch<T, true, kPair, PrefillForm<true, kLanes, true>>(typed, a);
          else if (rows)
            launch<T, true, kPair, PrefillForm<true, kLanes>>(typed, a);
          else
            launch<T, true, kPair, PrefillForm<false, kLanes>>(typed, a);
        };
        nblk == 8 ? form(std::integral_constant<int, 32>{}) : nblk == 4 ? form(std::integral_constant<int, 16>{})
                                                             : form(std::integral_constant<int, 8>{});
        return;
      }
    }
    if (plain_pair)
      launch<T, true, kPair, PlainForm>(typed, a);
    else if (plain_e2m1)
      launch<T, true, Elems::e2m1, PlainForm>(typed, a);
    else if (pair)
      launch<T, true, kPair>(typed, a);
    else if (vec)
      launch<T, true, Elems::runtime>(typed, a);
    else
      launch<T, false, Elems::runtime>(typed, a);
  });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("quantize_rows: launch failed: ") + cudaGetErrorString(err));
}

namespace {

struct Folds {
  KeyFold f[2];
};

// One CTA per (b*h, tile, K form), a thread per key; the tile's decision is the AND of its keys' exactness.
// The forms come as a __grid_constant__ parameter: indexed by blockIdx.z, a plain by-value parameter was
// copied to local memory in every thread (SASS).
template <int D, bool kE5M2>
__global__ void __launch_bounds__(kTile) fold_key_tiles_kernel(const __grid_constant__ Folds folds, int64_t N,
                                                                  int64_t row_pad) {
  constexpr int NB = D / 32;
  __shared__ uint32_t warp_max[kTile / 32];
  const KeyFold& fk = folds.f[blockIdx.z];
  uint8_t* codes = fk.codes;
  uint8_t* scales = fk.scales;
  float* row_scale = fk.row_scale;
  float* tile_scale = fk.tile_scale;
  const int64_t bh = blockIdx.y, tile = blockIdx.x, tiles = row_pad / kTile;
  const int64_t key = tile * kTile + threadIdx.x, slot = bh * row_pad + key;  // slot: index into row_scale
  // Every global load first (the tile's split flag, the key's row scale and codes), so the thread waits
  // one DRAM latency: the chain flag -> scale -> reduction -> codes waited three (11-13 us at N = 4096). A split tile's codes are then read for nothing (rare: MXFP4 keys fold whenever
  // their scales span at most 2^8).
  const int split = fk.tile_split[bh * tiles + tile];
  // Row scales are powers of two (or 0 past N): their bits order like their values.
  const uint32_t mine = __float_as_uint(row_scale[slot]);
  uint4 row[D / 16];
  if (key < N) {  // padding keys have no bytes
    const uint4* src = reinterpret_cast<const uint4*>(codes + (bh * N + key) * D);
#pragma unroll
    for (int i = 0; i < D / 16; ++i) row[i] = src[i];
  }
  if (split != 0) {  // some key keeps several scales: nothing to fold
    if (threadIdx.x == 0) tile_scale[bh * tiles + tile] = -1.0f;
    return;
  }
  const uint32_t wmax = __reduce_max_sync(0xffffffffu, mine);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = wmax;
  __syncthreads();
  uint32_t tmax = 0;
#pragma unroll
  for (int w = 0; w < kTile / 32; ++w) tmax = max(tmax, warp_max[w]);
  const float smax = __uint_as_float(tmax);
  bool exact = smax > 0.0f;
  const bool live = key < N && mine != 0;  // padding keys have scale 0
  if (live && mine != tmax) {  // (a key at the tile's scale keeps its bytes: a shift by 2^0 is exact)
    const int k = ilogbf(__uint_as_float(mine)) - ilogbf(smax);  // <= 0
#pragma unroll
    for (int i = 0; i < D / 16; ++i)
      row[i] = make_uint4(shift_fp8x4<kE5M2>(row[i].x, k, exact), shift_fp8x4<kE5M2>(row[i].y, k, exact),
                          shift_fp8x4<kE5M2>(row[i].z, k, exact), shift_fp8x4<kE5M2>(row[i].w, k, exact));
  }
  exact = __syncthreads_and(exact) != 0;
  if (threadIdx.x == 0) tile_scale[bh * tiles + tile] = exact ? smax : 0.0f;
  if (!exact || !live || mine == tmax) return;  // unchanged keys keep their bytes
  uint4* dst = reinterpret_cast<uint4*>(codes + (bh * N + key) * D);
#pragma unroll
  for (int i = 0; i < D / 16; ++i) dst[i] = row[i];
  row_scale[slot] = smax;
  const uint8_t code = uint8_t(tmax >> 23);  // smax = 2^(code - 127) (code 0: 2^-127 = 0x00400000, >> 23 is 0 too)
#pragma unroll
  for (int c = 0; c < NB; ++c) scales[slot * NB + c] = code;
}

}  // namespace

void fold_key_tiles(const KeyFold* folds, int count, int64_t BH, int64_t N, int64_t row_pad, int64_t d,
                    cudaStream_t stream) {
  if (row_pad % kTile != 0 || row_pad < N) throw Error("fold_key_tiles: row_pad must cover N in whole tiles");
  require_head_dim(PrefillHeadDims{}, d, "fold_key_tiles");
  if (count < 1 || count > 2) throw Error("fold_key_tiles: one or two K forms");
  if (BH == 0 || N == 0) return;
  if (BH > 65535) throw Error("fold_key_tiles: too many heads for the grid");
  // One launch for forms of one byte type (the usual E4M3 pair), else one each.
  const int launches = count == 2 && folds[0].e5m2 != folds[1].e5m2 ? 2 : 1;
  for (int l = 0; l < launches; ++l) {
    const int n = launches == 2 ? 1 : count;
    Folds f{};
    for (int i = 0; i < n; ++i) f.f[i] = folds[l + i];
    const dim3 grid(unsigned(row_pad / kTile), unsigned(BH), unsigned(n));
    auto go = [&](auto kernel) { kernel<<<grid, kTile, 0, stream>>>(f, N, row_pad); };
    with_head_dim(PrefillHeadDims{}, d, "fold_key_tiles", [&](auto dc) {
      constexpr int D = decltype(dc)::value;
      f.f[0].e5m2 ? go(fold_key_tiles_kernel<D, true>) : go(fold_key_tiles_kernel<D, false>);
    });
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("fold_key_tiles: launch failed: ") + cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
