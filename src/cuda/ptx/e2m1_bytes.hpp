// E2M1 codes widened for the tensor-core paths that take MXFP4 operands on sm_90, which has no 4-bit
// mma: to bytes by byte permutes (PTX prmt), or to f16 by placing their bits (the decode's V). Host
// and device: on the host prmt is emulated from the PTX ISA's definition, so the CPU tests check these
// widenings on every input word.
#pragma once
#include <cstdint>

#include "dmattn/hd.hpp"

namespace dmattn::cuda {

// PTX prmt.b32 (generic mode): byte i of the result is byte (sel nibble i & 7) of {b, a} (a holds
// bytes 0..3), or, where the nibble's bit 3 is set, that byte's top bit replicated over 8 bits.
DMATTN_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t src = uint64_t(b) << 32 | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (sel >> (4 * i)) & 0xF, byte = uint32_t(src >> (8 * (n & 7))) & 0xFF;
    d |= (n & 8 ? (byte & 0x80 ? 0xFFu : 0u) : byte) << (8 * i);
  }
  return d;
#endif
}

// Four E2M1 codes (low 16 bits, low nibble first) -> four E4M3 bytes holding their values (exact:
// every E2M1 value is an E4M3 value), for the decode kernel's FP8 mma and the quantize pass's
// tensor-core form: the magnitude by a byte permute of the 8-entry table, the sign by a permute in
// its sign-replicating mode (nibble i's sign bit lands on the top bit of the byte it selects).
DMATTN_HD uint32_t e2m1x4_to_e4m3x4(uint32_t x) {
  const uint32_t mag = prmt(0x3C383000u, 0x4C484440u, x & 0x7777u);  // 0 .5 1 1.5 | 2 3 4 6
  const uint32_t neg = prmt(x << 4, x, 0xD9C8u);                      // 0xFF where the code is negative
  return mag | (neg & 0x80808080u);
}

// Four E2M1 codes (low 16 bits) -> twice their values as unsigned bytes, split by sign: `pos` holds
// 2|v| where the code is positive and 0 elsewhere, `neg` the same for the negative codes, so that
// 2v = pos - neg byte by byte and a dot product with signed bytes q is pos.q - neg.q: two integer
// mmas (u8 x s8), exact. One permute each: a set nibble top bit (the sign) selects the replicated
// top bit of a table byte, which is 0, so it zeroes the codes of the other sign; `flipped` is the
// word with every sign bit inverted (x ^ 0x8888...), computed once for eight codes.
DMATTN_HD uint32_t e2m1x4_pos_x2(uint32_t x) { return prmt(0x03020100u, 0x0C080604u, x); }  // 0 1 2 3 | 4 6 8 12
DMATTN_HD uint32_t e2m1x4_neg_x2(uint32_t flipped) { return e2m1x4_pos_x2(flipped); }

// Eight E2M1 codes as four f16x2 words by bit placement, for the decode's P.V on f16 mmas. The f16
// with the code's sign at bit 15 and its three magnitude bits (e1 e0 m) at bits 11..9 is the code's
// value times 2^-14 exactly: e1 e0 are the two low exponent bits and m the top mantissa bit, so a
// normal code (e >= 1) is 2^(e-15)(1 + m/2) against 2^(e-1)(1 + m/2), and e = 0 gives the f16
// subnormal m x 2^-15 against m x 0.5 (the f16 mma takes subnormals; GpuMma tests it). The storage
// word holds the eight codes' 32 bits so that each output is one or two shifts and masks: per 16-bit
// half, output j's magnitude sits mag_shift(j) below bits 11..9 and its sign sign_shift(j) below bit
// 15 (offsets chosen so the four outputs' bits tile the half; no choice gives every output a single
// shift). Output j's low half is code 2j, its high half code 2j + 1. 6 logic ops and 5 shifts for 8
// codes, where widening to E4M3 bytes (e2m1x4_to_e4m3x4) and then to f16 took 14.
DMATTN_HD constexpr int mag_shift(int j) { return 3 * j; }                // 0 3 6 9
DMATTN_HD constexpr int sign_shift(int j) { return j < 2 ? 3 * j : j - 1; }  // 0 3 1 2
inline constexpr uint32_t kF16Mag = 0x0E000E00u, kF16Sign = 0x80008000u;

// The storage word of codes[0..7] (the host packs pages with it, the device cache its appends).
DMATTN_HD uint32_t e2m1x8_f16_pack(const uint8_t (&codes)[8]) {
  uint32_t w = 0;
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h) {
      const uint32_t c = codes[2 * j + h] & 0xFu;
      w |= (c & 7u) << (16 * h + 9 - mag_shift(j)) | (c >> 3) << (16 * h + 15 - sign_shift(j));
    }
  return w;
}

// The four f16x2 words (values x 2^-14) of a storage word.
DMATTN_HD void e2m1x8_to_f16x4(uint32_t w, uint32_t (&h)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    h[j] = mag_shift(j) == sign_shift(j) ? (w << mag_shift(j)) & (kF16Mag | kF16Sign)
                                         : ((w << mag_shift(j)) & kF16Mag) | ((w << sign_shift(j)) & kF16Sign);
}

}  // namespace dmattn::cuda
