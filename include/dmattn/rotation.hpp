// The randomized Hadamard rotation of Policy::rotate, one definition for host and device.
//
// A row x of Q or K (after the head's fp32 load) becomes FWHT(x * signs) blockwise: blocks of
// rotation_block(d) channels (all of d when d is a power of two), each multiplied elementwise by a
// fixed pseudo-random sign pattern and then transformed by the unnormalized Walsh-Hadamard butterfly
// in fp32, stage by stage (h = 1, 2, 4, ...; pairs (i, i + h) become (a + b, a - b)). Every backend
// runs those stages in that order, so rotated rows are bit-identical across backends.
//
// Unnormalized, the transform scales every score by the block size: (xH)(yH)^T = block * x.y^T. The
// softmax scale is divided by it (a power of two, so exactly), which makes the rotation an exact
// identity on the attention result in real arithmetic while it spreads channel outliers over all
// of a block's MX blocks before quantization.
#pragma once
#include "dmattn/hd.hpp"

namespace dmattn {

// The largest power of two that divides d (d itself when d is a power of two).
DMATTN_HD int rotation_block(int d) { return d & -d; }

// The softmax scale the scores of rotated rows take: `scale` divided by the block size (exactly).
DMATTN_HD float rotated_scale(float scale, int d, bool rotate) { return rotate ? scale / float(rotation_block(d)) : scale; }

// The signs of channels 8g .. 8g + 7 as bits 0..7 (1: -1): a hash of g (murmur3's finaliser), a
// fixed pseudo-random pattern (the rotation's seed); one hash serves a GPU lane's 8 channels.
DMATTN_HD uint32_t rotation_sign_bits(int g) {
  uint32_t h = uint32_t(g) * 0x9E3779B9u + 0x7F4A7C15u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The sign of channel i: +1 or -1.
DMATTN_HD float rotation_sign(int i) { return (rotation_sign_bits(i >> 3) >> (i & 7)) & 1u ? -1.0f : 1.0f; }

// Rotates x[0..d) in place (the definition above).
DMATTN_HD void rotate_row(float* x, int d) {
  const int blk = rotation_block(d);
  for (int i = 0; i < d; ++i) x[i] *= rotation_sign(i);
  for (int b0 = 0; b0 < d; b0 += blk)
    for (int h = 1; h < blk; h *= 2)
      for (int i = 0; i < blk; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float a = x[b0 + j], c = x[b0 + j + h];
          x[b0 + j] = a + c;
          x[b0 + j + h] = a - c;
        }
}

}  // namespace dmattn
