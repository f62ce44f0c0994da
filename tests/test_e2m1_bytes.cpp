// The byte-permute widenings of E2M1 codes (cuda/e2m1_bytes.hpp) on every 16-bit input, through the
// host emulation of PTX prmt, against the codec's values. The device runs the same functions with
// the prmt instruction (the GPU decode and quantize tests compare their results with the CPU).
#include <gtest/gtest.h>

#include "cuda/e2m1_bytes.hpp"
#include "dmattn/mx_codec.hpp"

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
