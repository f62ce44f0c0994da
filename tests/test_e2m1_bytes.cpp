// The widenings of E2M1 codes (cuda/e2m1_bytes.hpp): the byte permutes on every 16-bit input, through
// the host emulation of PTX prmt, and the f16 bit placement, against the codec's values. The device
// runs the same functions (the GPU decode and quantize tests compare their results with the CPU).
#include <gtest/gtest.h>

#include <cmath>

#include "cuda/ptx/e2m1_bytes.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

TEST(E2M1Bytes, PrmtEmulationFollowsThePtxDefinition) {
  const uint32_t a = 0x83028100u, b = 0x07860504u;  // bytes 0..7: 00 81 02 83 04 05 86 07
  EXPECT_EQ(cuda::prmt(a, b, 0x3210u), a);
  EXPECT_EQ(cuda::prmt(a, b, 0x7654u), b);
  EXPECT_EQ(cuda::prmt(a, b, 0x0246u), 0x00020486u);  // byte i of the result = byte (nibble i)
  EXPECT_EQ(cuda::prmt(a, b, 0x9BCEu), 0xFFFF00FFu);  // nibble top bit: the byte's sign replicated
  EXPECT_EQ(cuda::prmt(a, b, 0xFFFF3210u), a);        // only the low 16 bits select
}

TEST(E2M1Bytes, E4M3WideningHoldsEveryCodesValue) {
  for (uint32_t x = 0; x < 65536; ++x) {
    const uint32_t w = cuda::e2m1x4_to_e4m3x4(x | 0xABCD0000u);  // the high half is ignored
    for (int i = 0; i < 4; ++i) {
      const uint8_t code = uint8_t((x >> (4 * i)) & 0xF), byte = uint8_t(w >> (8 * i));
      const float want = decode_elem(Elem::e2m1, code);
      EXPECT_EQ(decode_elem(Elem::e4m3, byte), want) << x << " nibble " << i;
      EXPECT_EQ(byte >> 7, code >> 3) << x << " nibble " << i;  // -0 stays -0
    }
  }
}

TEST(E2M1Bytes, SignSplitBytesAreTwiceTheValue) {
  for (uint32_t x = 0; x < 65536; ++x) {
    const uint32_t pos = cuda::e2m1x4_pos_x2(x), neg = cuda::e2m1x4_neg_x2(x ^ 0x8888u);
    for (int i = 0; i < 4; ++i) {
      const uint8_t code = uint8_t((x >> (4 * i)) & 0xF);
      const int p = int((pos >> (8 * i)) & 0xFF), n = int((neg >> (8 * i)) & 0xFF);
      EXPECT_EQ(float(p - n), 2.0f * decode_elem(Elem::e2m1, code)) << x << " nibble " << i;
      EXPECT_TRUE(p == 0 || n == 0) << x << " nibble " << i;
      EXPECT_LE(p + n, 12);  // unsigned bytes of at most 12: a 32-term dot with |q| <= 12 stays below 2^13
    }
  }
}

// Every code at every one of the eight positions (the others random): the f16 the device reads is the
// code's value times 2^-14, sign included (-0 stays -0), and the packing uses each storage bit once.
TEST(E2M1Bytes, F16PlacementHoldsEveryCodesValue) {
  Rng rng(16);
  for (int rep = 0; rep < 64; ++rep)
    for (int pos = 0; pos < 8; ++pos)
      for (uint8_t code = 0; code < 16; ++code) {
        uint8_t codes[8];
        for (auto& c : codes) c = uint8_t(rng.next_u64() % 16);
        codes[pos] = code;
        uint32_t h[4];
        cuda::e2m1x8_to_f16x4(cuda::e2m1x8_f16_pack(codes), h);
        for (int i = 0; i < 8; ++i) {
          const uint16_t bits = uint16_t(h[i / 2] >> (16 * (i % 2)));
          EXPECT_EQ(std::ldexp(to_float(fp16{bits}), 14), decode_elem(Elem::e2m1, codes[i])) << "position " << i;
          EXPECT_EQ(bits >> 15, codes[i] >> 3u) << "position " << i;
        }
      }
  uint32_t all = 0;  // one set code at a time: the 8 x 4 bits land on 32 distinct storage bits
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 4; ++b) {
      uint8_t codes[8] = {};
      codes[i] = uint8_t(1u << b);
      const uint32_t w = cuda::e2m1x8_f16_pack(codes);
      EXPECT_EQ(w & (w - 1), 0u);
      EXPECT_EQ(all & w, 0u);
      all |= w;
    }
  EXPECT_EQ(all, 0xFFFFFFFFu);
}
