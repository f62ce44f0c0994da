// S^T for one warp's 32 keys of a page against the CTA's query rows: the K operands read from a page
// record in its format, the block dots on the tensor cores, promoted by the block scales in the oracle's order.
#pragma once
#include <cstdint>

#include "cuda/decode/kv_record.hpp"
#include "cuda/decode/params.cuh"
#include "cuda/ptx/fp8.cuh"
#include "cuda/ptx/mma.cuh"
#include "dmattn/format.hpp"

namespace dmattn::cuda::decode {

// The d index of contraction slot k of a 32-wide block, in both K's A and q's B fragments: lane t's
// slots 4t..4t+3 and 16+4t..16+4t+3 are d = 8t..8t+7, so a lane reads one 8-byte run of FP8 codes
// (4 bytes of E2M1) per key and block. A dot is a sum, so permuting its terms in both operands alike
// leaves it unchanged (up to the mma's own summation order, which the oracle does not fix either).
__device__ __forceinline__ int d_of_slot(int k) { return 8 * ((k % 16) / 4) + 4 * (k / 16) + k % 4; }

// E2M1 pages run on the FP8 tensor cores with their codes widened to E4M3 bytes (exact): the
// products of two E2M1 values are multiples of 1/4 below 37 and a 32-term sum stays below 2^11, so
// the mma's sum is exact (GpuMma.Fp8BlockDotPrecision asserts it) and equals the oracle's.
// (fp8.cuh: e2m1x4_to_e4m3x4 widens four codes a word.)

// The E8M0 scale code in byte c of `word` as a float. Cache pages hold no NaN scale (append rejects
// non-finite input) and code 0 (2^-127) only scales all-zero blocks, so the plain exponent field is
// enough here: two instructions instead of decode_e8m0's special cases.
// (The byte goes to bits 16..23 by one permute and up 7 by a multiply on the FMA pipe: shift, mask and
// shift took three instructions, two of them on the busier ALU pipe.)
__device__ __forceinline__ float e8m0_of_byte(uint32_t word, int c) {
  return __uint_as_float(prmt(word, 0u, 0x4044u | uint32_t(c) << 8) << 7);
}

// A fragment registers (slots 4t..4t+3 and 16+4t..) of block c of a key row (D/2 bytes for E2M1, else
// D; chunks swizzled, kv_record.hpp): FP8 bytes (E2M1 and FP6 codes widened to E4M3, exactly).
template <int D, Elem E>
__device__ __forceinline__ void k_words(const uint8_t* row, int key, int c, int t, const uint8_t* lut, uint32_t& b0,
                                        uint32_t& b1) {
  if constexpr (E == Elem::e2m1) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + swizzled(D / 32, key, c * 16 + 4 * t));
    b0 = e2m1x4_to_e4m3x4(w);
    b1 = e2m1x4_to_e4m3x4(w >> 16);
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(row + swizzled(D / 16, key, c * 32 + 8 * t));
    if constexpr (E == Elem::e4m3 || E == Elem::e5m2) {
      b0 = w.x;
      b1 = w.y;
    } else {  // FP6: one code per byte
      auto widen = [&](uint32_t x) {
        return uint32_t(lut[x & 0x3F]) | uint32_t(lut[(x >> 8) & 0x3F]) << 8 | uint32_t(lut[(x >> 16) & 0x3F]) << 16 |
               uint32_t(lut[(x >> 24) & 0x3F]) << 24;
      };
      b0 = widen(w.x);
      b1 = widen(w.y);
    }
  }
}

// The key's E8M0 block scales, four blocks a word (byte c % 4 of word c / 4 = block c): one word up to
// d = 128, two at d = 256.
template <int NB>
struct ScaleWords {
  static constexpr int kWords = (NB + 3) / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ ScaleWords(const uint8_t* ks, int key) {
    if constexpr (NB == 8) {
      const uint2 x = *reinterpret_cast<const uint2*>(ks + key * 8);
      w[0] = x.x;
      w[1] = x.y;
    } else if constexpr (NB == 4) {
      w[0] = *reinterpret_cast<const uint32_t*>(ks + key * 4);
    } else {
      static_assert(NB == 2);
      w[0] = *reinterpret_cast<const uint16_t*>(ks + key * 2);
    }
  }
  // Block c's scale as a float (a select between the words, not an index: the E2M1 path's block
  // loop is not fully unrolled, and an indexed register array would go to local memory).
  __device__ __forceinline__ float scale(int c) const {
    if constexpr (kWords == 1)
      return e8m0_of_byte(w[0], c);
    else
      return e8m0_of_byte(c < 4 ? w[0] : w[1], c % 4);
  }
};

// The oracle's blockwise promotion of one block's mma result d (an m16n8 fragment: rows g, g + 8 x
// columns 2t, 2t + 1) into s: s += (row scale x column scale) * d. m0, m1: the scales of rows g and
// g + 8 (keys for S^T, channels for O^T); n: those of columns 2t, 2t + 1 (query rows).
__device__ __forceinline__ void promote(float (&s)[4], float m0, float m1, float2 n, const float* d) {
  s[0] += (m0 * n.x) * d[0];
  s[1] += (m0 * n.y) * d[1];
  s[2] += (m1 * n.x) * d[2];
  s[3] += (m1 * n.y) * d[3];
}

// The A fragment words of block c of an E2M1 key row as twice its values in unsigned bytes, split
// by sign (pos: slots 4t.. and 16+4t..; neg likewise; e2m1_bytes.hpp): 7 instructions for 8 codes.
template <int D>
__device__ __forceinline__ void k_split_words(const uint8_t* row, int key, int c, int t, uint32_t& p0, uint32_t& p1,
                                              uint32_t& n0, uint32_t& n1) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(row + swizzled(D / 32, key, c * 16 + 4 * t)), f = w ^ 0x88888888u;
  p0 = e2m1x4_pos_x2(w);
  p1 = e2m1x4_pos_x2(w >> 16);
  n0 = e2m1x4_neg_x2(f);
  n1 = e2m1x4_neg_x2(f >> 16);
}

// The E2M1 block dot x4 as pos.q - neg.q, two independent integer mmas (exact). Both sums start
// from the bits of 1.5 * 2^23 (each stays within 2^22 of it), so they land in floats of one binade and
// one subtraction each gives the dot exactly, with no int-to-float conversion.
__device__ __forceinline__ void mma_e2m1_block(float d[4], const uint32_t (&pos)[4], const uint32_t (&neg)[4], uint32_t b0,
                                               uint32_t b1) {
  constexpr int kMagic = 0x4B400000;
  const int c0[4] = {kMagic, kMagic, kMagic, kMagic};
  int dp[4], dn[4];
  mma_u8s8_block(dp, pos, b0, b1, c0);
  mma_u8s8_block(dn, neg, b0, b1, c0);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = __int_as_float(dp[i]) - __int_as_float(dn[i]);
}

// S^T = K.q^T for the warp's 32 keys (2 tiles of 16, the mma's M) against the CTA's rows (kNR tiles
// of 8, its N): with the query rows in N, a GQA group of 4 or 8 rows wastes no more than half of
// the mma (in M it wasted three quarters). Per 32-wide block of d an mma into a fresh accumulator,
// then s += (sk * sq) * dot, blocks in order (the oracle's order). E2M1 pages run the integer mma
// (mma_e2m1_block; their sq holds a quarter of q's scale), the others the FP8 one.
// s[mt][nr][i]: key 16mt + g + 8*(i/2) of the warp's keys, row 8nr + 2t + i%2.
template <int D, int kNR, Elem E>
__device__ __forceinline__ void block_scores(const uint8_t* rec, const uint32_t* qb, const float* sq, const uint8_t* lut,
                                             float (&s)[2][kNR][4]) {
  constexpr int NB = D / 32, kRows = 8 * kNR;
  constexpr bool kInt = E == Elem::e2m1;
  constexpr int kRow = record_k_row(D, kInt);
  const uint8_t *K = rec + record_k(D, kInt), *ks = rec + record_k_scales(D);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const ScaleWords<NB> w[2][2] = {{{ks, g}, {ks, g + 8}}, {{ks, 16 + g}, {ks, 16 + g + 8}}};  // keys 16mt + g + 8h
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][nr][i] = 0.0f;
  }
  // The E2M1 path, unrolled over every block, needs more registers than the many-CTA instances (168 at
  // three, 128 at four) or the 16-row bf16-V one (255) have (ptxas spilled): two blocks at a time fit, or
  // one at 16 rows.
  constexpr int kUnrollC = kInt ? 3 - kNR : NB;
#pragma unroll kUnrollC
  for (int c = 0; c < NB; ++c) {
    uint32_t b[kNR][2];
    float2 sqr[kNR];  // rows 8nr + 2t, +1
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr) {
      b[nr][0] = qb[((c * kNR + nr) * 2) * 32 + lane];
      b[nr][1] = qb[((c * kNR + nr) * 2 + 1) * 32 + lane];
      sqr[nr] = *reinterpret_cast<const float2*>(sq + c * kRows + 8 * nr + 2 * t);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int key = 16 * mt + g;
      uint32_t a[4], an[4];
      if constexpr (kInt) {
        k_split_words<D>(K + key * kRow, key, c, t, a[0], a[2], an[0], an[2]);
        k_split_words<D>(K + (key + 8) * kRow, key + 8, c, t, a[1], a[3], an[1], an[3]);
      } else {
        k_words<D, E>(K + key * kRow, key, c, t, lut, a[0], a[2]);
        k_words<D, E>(K + (key + 8) * kRow, key + 8, c, t, lut, a[1], a[3]);
      }
      const float sk0 = w[mt][0].scale(c), sk1 = w[mt][1].scale(c);
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr) {
        float d[4];
        if constexpr (kInt)
          mma_e2m1_block(d, a, an, b[nr][0], b[nr][1]);
        else
          mma_fp8_block<E == Elem::e5m2>(d, a, b[nr][0], b[nr][1]);
        promote(s[mt][nr], sk0, sk1, sqr[nr], d);
      }
    }
  }
}

// Page scores for the page's format slot sl (its element type e): block_scores' instance for it, with
// q's fragments and scales of that slot (qb, sq: Smem::kQb, kSq; lut: the FP6 table).
template <int D, int kNR>
__device__ __forceinline__ void page_scores(Elem e, int sl, const uint8_t* rec, const uint32_t* qb, const float* sq,
                                            const uint8_t* lut, float (&s)[2][kNR][4]) {
  constexpr int NB = D / 32, kRows = 8 * kNR;
  const uint32_t* qs = qb + sl * NB * kNR * 64;
  const float* sqs = sq + sl * NB * kRows;
  const uint8_t* lt = lut + 64 * sl;
  switch (e) {  // E2M1 first: the default's low format, most pages' (the compare chain's order)
    case Elem::e2m1: block_scores<D, kNR, Elem::e2m1>(rec, qs, sqs, lt, s); break;
    case Elem::e4m3: block_scores<D, kNR, Elem::e4m3>(rec, qs, sqs, lt, s); break;
    case Elem::e5m2: block_scores<D, kNR, Elem::e5m2>(rec, qs, sqs, lt, s); break;
    case Elem::e3m2: block_scores<D, kNR, Elem::e3m2>(rec, qs, sqs, lt, s); break;
    case Elem::e2m3: block_scores<D, kNR, Elem::e2m3>(rec, qs, sqs, lt, s); break;
  }
}

// Sink keys (Params::sink_keys): their exact scores (Params::sink, from the query pre-pass) replace
// the quantized ones of page j, for the CTA's rows from q row qrow0 (rows real ones).
template <int kNR>
__device__ __forceinline__ void exact_sink_scores(const Params& p, float (&s)[2][kNR][4], int j, int64_t qrow0, int rows) {
  if (j * kTile >= p.sink_keys) return;
  for_each_score<kNR>(s, j, [&](float& x, int key, int row) {
    if (key < p.sink_keys && row < rows) x = p.sink[(qrow0 + row) * p.sink_keys + key];
  });
}

}  // namespace dmattn::cuda::decode
