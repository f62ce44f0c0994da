// O^T += V^T.P^T for one warp's 32 keys of a page, on the tensor cores into the warp's own
// accumulator of all d columns (P^T's B fragments from S^T's accumulators by movmatrix): P rounded to
// bf16 (as the oracle) times bf16 V, or with pv = mxfp8 / mxfp4 P in MXFP8 (one block: the warp's 32
// keys) times V's MX codes as f16 block dots.
#pragma once
#include <cstdint>

#include "cuda/decode/kv_record.hpp"
#include "cuda/decode/softmax.cuh"
#include "cuda/ptx/fp8.cuh"
#include "cuda/ptx/mma.cuh"
#include "dmattn/mx_codec.hpp"

namespace dmattn::cuda::decode {

// P's MXFP8 E4M3 block over this warp's 32 keys (one MX block) for rows 8nr + 2t + r: its E8M0
// scale as a float (ps) and the factor to element range (inv), the amax taken over the lanes g.
template <int kNR>
__device__ __forceinline__ void p_block_scales(const float (&sc)[2][kNR][4], int nr, ScaleRule rule, float (&inv)[2],
                                               float (&ps)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float amax = 0.0f;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) amax = fmaxf(amax, fmaxf(sc[mt][nr][r], sc[mt][nr][2 + r]));
    const uint8_t e = choose_e8m0_nonneg(over_g(amax, kMaxOp), Elem::e4m3, rule);  // p in [0, 1]: finite
    inv[r] = inverse_e8m0(e);
    ps[r] = decode_e8m0(e);
  }
}

// An 8x8 matrix of 16-bit pairs transposed across the warp: lane (g, t) gives row g, columns 2t and
// 2t+1, and receives row g of the transpose (columns 2t, 2t+1 of it).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// The accumulator's rows rescaled for their new maxima (PageSoftmax::update's alpha).
template <int D, int kNR>
__device__ __forceinline__ void rescale(float (&acc)[D / 16][kNR][4], const float (&alpha)[kNR][2]) {
#pragma unroll
  for (int md = 0; md < D / 16; ++md)
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[md][nr][i] *= alpha[nr][i % 2];
}

// acc[md][nr][i]: O^T's columns 16md + g (+8 for i >= 2) of rows 8nr + 2t (+1 for odd i); sc: P as
// PageSoftmax::update leaves it; V: the record's V region (kv_record.hpp), kVB its bits; rule: P's
// block scales' rule (MX V).
template <int D, int kVB, int kNR>
__device__ __forceinline__ void accumulate_pv(float (&acc)[D / 16][kNR][4], const float (&sc)[2][kNR][4], const uint8_t* V,
                                              ScaleRule rule) {
  constexpr int MD = D / 16;
  constexpr bool kPV8 = kVB != 16;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if constexpr (kPV8) {
    // P in MXFP8 E4M3, one scale per row over the warp's 32 keys (one MX block). The codes of
    // (key, rows 2t, 2t+1) widened to f16 and times their block scale x 2^14 (a power of two in f16,
    // so the products are P's values x 2^14, exact down to 2^-35; a block whose scale x 2^14 is
    // below f16's 2^-24 holds values under 448 x 2^-38 and becomes zeros) go to P^T's B fragments
    // (row g, keys 2t, 2t+1 of each 8-key group) by movmatrix: bq[nr][q] holds keys 8q + 2t, 8q + 2t + 1,
    // the f16 mma's slots in natural order over two m16n8k16 (keys 0..15, 16..31). With P's scale in
    // its values, each block's promotion is one FFMA an element. V^T's A fragments hold the same keys:
    // E4M3 bytes 8t.. of a column's 32 keys (vt_position) widened to f16 (the 2^-14 goes into V's
    // scale), or an E2M1 word placed as f16 values x 2^-14 (e2m1x8_to_f16x4), which cancels P's 2^14.
    uint32_t bq[kNR][4];
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr) {
      float inv[2], ps[2];
      p_block_scales<kNR>(sc, nr, rule, inv, ps);
      const uint32_t s2 = f16x2_rn(ps[0] * 16384.0f, ps[1] * 16384.0f);
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // key groups 0..3 (keys 8q..8q+7): (mt, half) = (q / 2, q % 2)
        const float* x = sc[q / 2][nr] + 2 * (q % 2);
        const uint32_t h = fp8x2_to_f16x2<false>(fp8x2_encode<false>(x[0] * inv[0], x[1] * inv[1]));
        bq[nr][q] = movmatrix_trans(h2_rn<'*'>(h, s2));
      }
    }
    const uint8_t* vsc = V + record_vt_row(kVB) * D;  // this block's scale per column
#pragma unroll
    for (int md = 0; md < MD; ++md) {
      // Rows 16md + g (+8) of V^T: 4 rows of 32 bytes a half warp (E2M1: 8 rows of 16): no bank conflicts.
      uint32_t a1[4], a2[4];
      if constexpr (kVB == 8) {
        const uint2 lo = *reinterpret_cast<const uint2*>(V + (16 * md + g) * 32 + 8 * t);
        const uint2 hi = *reinterpret_cast<const uint2*>(V + (16 * md + g + 8) * 32 + 8 * t);
        const uint32_t a[4] = {lo.x, hi.x, lo.y, hi.y};  // the m16n8k32 A fragment
        fp8_a_to_f16<false>(a, a1, a2);
      } else {
        uint32_t fl[4], fh[4];
        e2m1x8_to_f16x4(*reinterpret_cast<const uint32_t*>(V + (16 * md + g) * 16 + 4 * t), fl);
        e2m1x8_to_f16x4(*reinterpret_cast<const uint32_t*>(V + (16 * md + g + 8) * 16 + 4 * t), fh);
        a1[0] = fl[0], a1[1] = fh[0], a1[2] = fl[1], a1[3] = fh[1];
        a2[0] = fl[2], a2[1] = fh[2], a2[2] = fl[3], a2[3] = fh[3];
      }
      constexpr float kVUnit = kVB == 8 ? 1.0f / 16384.0f : 1.0f;  // 2^-14 (exact, at worst a float subnormal)
      const float v0 = e8m0_of_byte(vsc[16 * md + g], 0) * kVUnit, v1 = e8m0_of_byte(vsc[16 * md + g + 8], 0) * kVUnit;
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr) {
        float d[4];
        mma_f16_block(d, a1, a2, bq[nr]);
        acc[md][nr][0] += v0 * d[0];
        acc[md][nr][1] += v0 * d[1];
        acc[md][nr][2] += v1 * d[2];
        acc[md][nr][3] += v1 * d[3];
      }
    }
  } else {  // P rounded to bf16 (as the oracle) times bf16 V, 16 keys a step
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint32_t bq[kNR][2];  // P^T: keys 2t, 2t+1 (+8) of row 8nr + g
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr) {
        bq[nr][0] = movmatrix_trans(bf16x2_rn(sc[mt][nr][0], sc[mt][nr][1]));
        bq[nr][1] = movmatrix_trans(bf16x2_rn(sc[mt][nr][2], sc[mt][nr][3]));
      }
      // V^T's A fragments by ldmatrix.trans from V's key rows: matrices (columns +8 for odd,
      // keys +8 for the upper two).
      const int mi = lane / 8, key = 16 * mt + 8 * (mi / 2) + lane % 8;
#pragma unroll
      for (int md = 0; md < MD; ++md) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, V + key * 2 * D + swizzled(D / 8, key, (16 * md + 8 * (mi % 2)) * 2));
#pragma unroll
        for (int nr = 0; nr < kNR; ++nr) mma_16816<true>(acc[md][nr], a, bq[nr][0], bq[nr][1]);
      }
    }
  }
}

}  // namespace dmattn::cuda::decode
