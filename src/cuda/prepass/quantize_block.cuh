// The MX block encoder of the GPU quantize pass (quantize.cu): bit-identical to the CPU codec
// (dmattn/mx_codec.hpp), checked by GpuQuantize. (Quantizing Q inside the prefill kernel with it
// measured slower than this separate pass: bench/RESULTS.md.)
#pragma once

#include "cuda/common/with_elem.cuh"
#include "cuda/ptx/fp8.cuh"
#include "cuda/ptx/mma.cuh"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {

// Four lanes share one 32-block, eight consecutive elements each.
constexpr int kPerLane = 8;

// A lane's eight codes, packed: E2M1 nibbles in x (low nibble first) unless as FP8 bytes; else
// eight bytes, element 0 in the low byte of x. Packed words let the conversions run two (FP8) or
// four (E2M1 -> E4M3 bytes) elements an instruction, and keep branches out of the element loop: the
// per-element encoder with a branch per element cost ~50 instructions an element (SASS).

// Four FP8 bytes shifted by 2^k (k <= 0), and whether every shifted value stays exact. Every FP8
// value is an f16 value (E5M2 shares f16's exponent range), so each product is exact in f16 whenever
// it is an FP8 value at all (nonzero FP8 values are >= 2^-16 with <= 4 significant bits); one that
// is not either fails the round trip through FP8 or has rounded to zero in f16, which the nonzero
// test catches. Below 2^-24 (not an f16) no nonzero FP8 value stays representable: the factor is then 0,
// which keeps zeros (signs included) and fails every nonzero value. No branches on k, which differs
// between the blocks of a warp (k = 0 multiplies by 1, exactly); encode_lane skips the call where k = 0
// in every lane.
template <bool kE5M2>
__device__ __forceinline__ uint32_t shift_fp8x4(uint32_t w, int k, bool& exact) {
  const uint32_t p = k >= -14 ? uint32_t(15 + k) << 10 : k >= -24 ? 1u << (24 + k) : 0u;  // 2^k as f16 bits
  const uint32_t scale2 = p | p << 16;
  uint32_t out = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t x = fp8x2_to_f16x2<kE5M2>(w >> (16 * h));
    const uint32_t y = h2_rn<'*'>(x, scale2);
    const uint32_t f = f16x2_to_fp8x2<kE5M2>(y);
    const uint32_t xm = x & 0x7FFF7FFFu, ym = y & 0x7FFF7FFFu;
    exact &= fp8x2_to_f16x2<kE5M2>(f) == y && ((xm & 0xFFFFu) == 0 || (ym & 0xFFFFu) != 0) && ((xm >> 16) == 0 || (ym >> 16) != 0);
    out |= f << (16 * h);
  }
  return out;
}

// Two values already divided by their block's scale, rounded to E2M1 values (nearest-even,
// saturating at 6: the codec's encode_e2m1) and returned as an f16 pair, lo in the low half, signs
// kept (a negative value that rounds to zero gives -0, the codec's code 8). Exact only where both
// values are f16 values already, as a bf16 or fp16 input divided by a power of two is down to 2^-17
// (smaller ones round to 0 either way): an f32 input would round twice. Both magnitudes are below 8,
// as every finite block's values are over its scale (the scale puts the amax in [4, 8) or lower);
// a non-finite block's codes are zeroed by the caller. Per half: the binade's exponent, raised to 1
// (below 1 E2M1 keeps the step 0.5 of [1, 2)), names a power of two M whose f16 ulp is the E2M1 step
// there; (a + M) - M rounds a to that step. Nine instructions for two values, where the codec's
// float-bit encoder takes about ten for one.
__device__ __forceinline__ uint32_t e2m1_round_f16x2(float lo, float hi) {
  const uint32_t h = f16x2_rn(lo, hi);
  const uint32_t a = h & 0x7FFF7FFFu;
  // M = max(binade, 1.0) x 2^9 (exponent field + 9): ulp(M) = the step; binades above 4 do not occur.
  const uint32_t m = __viaddmax_u16x2(a & 0x7C007C00u, 0x24002400u, 0x60006000u);
  uint32_t r = h2_rn<'-'>(h2_rn<'+'>(a, m), m);
  asm("min.f16x2 %0, %0, %1;" : "+r"(r) : "r"(0x46004600u));  // 6.0: saturate
  return r | (h & 0x80008000u);
}

// Four f16 pairs of E2M1 values (e2m1_round_f16x2, elements 0..7 in order) as eight E2M1 nibbles,
// low nibble first. Times 2^-14 an E2M1 value's f16 bits are its code << 9 (0.5 -> 2^-15 = 0x0200,
// 6 -> 1.5 x 2^-12 = 0x0E00), sign at bit 15: byte 1 of each half is s000ccc0.
__device__ __forceinline__ uint32_t e2m1_nibbles(const uint32_t (&r)[4]) {
  uint32_t t[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) t[i] = h2_rn<'*'>(r[i], 0x04000400u);
  uint32_t h[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t g = prmt(t[2 * i], t[2 * i + 1], 0x7531u);            // elements 4i..4i+3, s000ccc0 each
    const uint32_t n = ((g >> 1) & 0x07070707u) | ((g >> 4) & 0x08080808u);  // a nibble a byte
    h[i] = n | (n >> 4);                                                  // bytes 0 and 2 hold two nibbles
  }
  return prmt(h[0], h[1], 0x6420u);
}

// Four f16 pairs (elements 0..7) as eight FP8 bytes, element 0 in the low byte of x; every value is
// an E4M3 value (E2M1 values, shifted by at most 2^-8: see encode_lane), so the conversion is exact.
__device__ __forceinline__ uint2 e4m3_bytes_of_f16x2(const uint32_t (&r)[4]) {
  uint32_t b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = f16x2_to_fp8x2<false>(r[i]);
  return make_uint2(b[0] | b[1] << 16, b[2] | b[3] << 16);
}

// The lanes of the warp that hold this lane's row: row_lanes consecutive lanes (a power of two, at
// most 32), so a row's AND is one vote where shuffle rounds took two instructions a round. (A row's
// max stays shuffles: redux.sync over part of a warp compiles to a divergence check and a move from a
// uniform register, no fewer instructions than two rounds.)
__device__ __forceinline__ uint32_t row_mask(int row_lanes) {
  const uint32_t ones = row_lanes >= 32 ? 0xffffffffu : (1u << row_lanes) - 1u;
  return ones << ((threadIdx.x % 32) & ~uint32_t(row_lanes - 1));
}

// The largest of the row's block scale codes (its blocks' lanes hold them four times over, so the
// shuffles start at 4; every lane of the warp calls it).
__device__ __forceinline__ int row_max_code(int sc, int row_lanes) {
  for (int s = 4; s < row_lanes; s <<= 1) sc = max(sc, __shfl_xor_sync(0xffffffffu, sc, s));
  return sc;
}

// Whether p holds in every lane of the row (every lane of the warp calls it).
__device__ __forceinline__ bool row_all(bool p, uint32_t mask) { return (__ballot_sync(0xffffffffu, p) & mask) == mask; }

// One lane's share (kPerLane elements) of a 32-block held by 4 consecutive lanes, whose amax and
// non-finite flag the caller has combined: the block's E8M0 scale (returned) and the packed codes
// (above); with fp8_bytes, the codes as FP8 bytes (E5M2 for E5M2, E4M3 for every other element,
// which holds its values exactly), and with fold as well, shifted to the largest scale of the row's
// row_lanes lanes where every block of the row stays exact (then all its blocks return that
// scale). Bit-identical to the codec (GpuQuantize). Every lane of the warp must call it (shuffles).
// round_fold (uniform across the grid): E4M3 and E5M2 rows whose block scales span at most 2^8 fold
// even where a shifted value falls below the element type's subnormal step and rounds to it
// (QuantTarget::round_fold says what that costs).
// kHalf: the values came from bf16 or fp16, which lets E2M1 round two values at a time in f16.
template <Elem E, bool kHalf>
__device__ __forceinline__ uint32_t encode_lane(ScaleRule rule, const float (&v)[kPerLane], float amax, bool bad,
                                               bool fp8_bytes, bool fold, bool round_fold, int row_lanes, uint2& w,
                                               uint32_t& row_max) {
  constexpr bool kE5M2 = E == Elem::e5m2;
  // 32-bit codes: no byte masks. A finite block's code is at most 253 (choose_e8m0_nonneg), so an OR
  // with 0xFF gives the NaN scale, without the branch a select compiled to.
  uint32_t sc = uint32_t(choose_e8m0_nonneg(amax, E, rule)) | (bad ? kE8M0NaN : 0u);
  // With fold: the row's largest scale (fold is uniform across the grid: every lane shuffles).
  const int smax = fold ? row_max_code(int(sc), row_lanes) : int(sc);
  row_max = uint32_t(smax);
  const int k = int(sc) - smax;  // <= 0: with fold, this block's values shift down by 2^k
  // Where no block of the warp shifts (k = 0 in every lane, as in K's rows of one scale) the codes stand
  // as they are: one vote skips the shift for the whole warp, which branching on each lane's k cannot.
  const bool none = fold && __all_sync(0xffffffffu, k == 0);
  // 2^-X as one factor: a product by a power of two rounds once, exactly like the codec's ldexp.
  // inverse_e8m0 without its branch for codes 254 and 255: 254 does not occur and the NaN scale's
  // codes are zeroed below.
  const float inv = __uint_as_float((254u - sc) << 23);
  bool shifted = false;  // f holds the folded bytes already (E2M1 from f16, k >= -8)
  uint2 f = make_uint2(0u, 0u);
  if constexpr (E == Elem::e4m3 || E == Elem::e5m2) {
    uint32_t p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = fp8x2_encode<kE5M2>(v[2 * i] * inv, v[2 * i + 1] * inv);
    w = make_uint2(p[0] | p[1] << 16, p[2] | p[3] << 16);
  } else if constexpr (E == Elem::e2m1 && kHalf) {
    uint32_t r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = e2m1_round_f16x2(v[2 * i] * inv, v[2 * i + 1] * inv);
    if (fp8_bytes) {
      w = e4m3_bytes_of_f16x2(r);
      // Every E2M1 value times 2^k, -8 <= k <= 0, is an E4M3 value (the smallest, 0.5 x 2^-8 and
      // 1.5 x 2^-8, are multiples of E4M3's 2^-9): the shift is exact, in f16 and in the bytes.
      if (fold && !none && k >= -8) {
        const uint32_t p = uint32_t(15 + k) << 10, pk = p | p << 16;
        uint32_t q[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = h2_rn<'*'>(r[i], pk);
        f = e4m3_bytes_of_f16x2(q);
        shifted = true;
      }
    } else {
      w = make_uint2(e2m1_nibbles(r), 0u);
    }
  } else if constexpr (E == Elem::e2m1) {
    // encode_e2m1_fast without its NaN test (a non-finite block's codes are zeroed below), the sign
    // moved straight from bit 31 to bit 4i + 3.
    uint32_t n = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const uint32_t u = __float_as_uint(v[i] * inv);
      n += e2m1_magnitude_code(u & 0x7FFFFFFFu) << (4 * i);
      n |= (u >> (28 - 4 * i)) & (8u << (4 * i));
    }
    w = fp8_bytes ? make_uint2(e2m1x4_to_e4m3x4(n), e2m1x4_to_e4m3x4(n >> 16)) : make_uint2(n, 0u);
  } else {  // FP6: the codec's generic rounding, one byte a code
    const ElemSpec spec = elem_spec(E);
    uint32_t p[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      uint8_t c = encode_elem(spec, v[i] * inv);
      if (fp8_bytes) c = fp8_encode<false>(decode_elem(E, c));
      p[i / 4] |= uint32_t(c) << (8 * (i % 4));
    }
    w = make_uint2(p[0], p[1]);
  }
  if (sc == kE8M0NaN) w = make_uint2(0u, 0u);  // the NaN scale carries the block; its codes are zeros
  if (fold) {  // uniform across the grid: every lane takes part in the shuffles
    const bool finite = !bad && smax != kE8M0NaN;
    bool exact = finite;
    if (!shifted) f = none ? w : make_uint2(shift_fp8x4<kE5M2>(w.x, k, exact), shift_fp8x4<kE5M2>(w.y, k, exact));
    exact = row_all(exact, row_mask(row_lanes));
    if constexpr (E == Elem::e4m3 || E == Elem::e5m2)
      if (round_fold) exact |= row_all(finite && k >= -8, row_mask(row_lanes));  // f rounded (RNE) where inexact
    if (exact) {
      w = f;
      sc = uint32_t(smax);
    }
  }
  return sc;
}

// The block's amax and whether it holds NaN/Inf, combined over its 4 lanes (every lane calls it).
// On magnitude bits, unsigned order is float order and Inf and NaN sit above every finite value: one
// integer max per element and one shuffle chain give both.
__device__ __forceinline__ void block_stats(const float (&v)[kPerLane], float& amax, bool& bad) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) m = max(m, __float_as_uint(v[i]) & 0x7FFFFFFFu);
#pragma unroll
  for (int s = 1; s < 4; s <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, s));
  bad = m >= 0x7F800000u;
  amax = __uint_as_float(m);
}

// Whether every block of the row (its row_lanes lanes, 4 a block) has the scale code sc (every lane
// of the warp calls it). row_max: the row's largest code where the caller has it (encode_lane with
// fold), else -1.
__device__ __forceinline__ bool row_scales_equal(uint32_t sc, int row_lanes, int row_max) {
  if (row_max < 0) row_max = row_max_code(int(sc), row_lanes);
  return row_all(sc == uint32_t(row_max), row_mask(row_lanes));
}

}  // namespace dmattn::cuda
