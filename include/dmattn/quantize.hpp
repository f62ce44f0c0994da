// Quantization of row-major matrices along their last axis, in two shapes:
//  - packed codes + scale codes (the storage form, what `dmattn quantize` writes);
//  - decoded element values + per-block scales as floats (what compute backends consume).
// Both come from the same codec calls, so they describe the same numbers.
#pragma once
#include <cstdint>
#include <vector>

#include "dmattn/format.hpp"

namespace dmattn {

struct Quantized {
  Format format{};
  ScaleRule rule{};
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;   // [rows, code_cols()]: E2M1 two per byte (low nibble first), others one per byte
  std::vector<uint8_t> scales;  // [rows, scale_cols()]: E8M0, or E4M3 for NVFP4
  float tensor_scale = 1.0f;    // NVFP4's per-tensor fp32 scale; 1 otherwise

  int64_t code_cols() const;
  int64_t scale_cols() const;
};

// Throws dmattn::Error for bf16 (no codes) and for non-finite tensor amax with NVFP4.
Quantized quantize(const float* x, int64_t rows, int64_t cols, Format f, ScaleRule rule);

// Element c of one row's codes: E2M1 packed two per byte (low nibble first), others one per byte.
inline uint8_t element_code(const uint8_t* row, int64_t c, bool packed) {
  return packed ? uint8_t((row[c / 2] >> (4 * (c % 2))) & 0xF) : row[c];
}
// Sets element c of one row's codes, packed as element_code reads them.
inline void set_element_code(uint8_t* row, int64_t c, bool packed, uint8_t code) {
  if (packed)
    row[c / 2] = uint8_t((row[c / 2] & (c % 2 ? 0x0F : 0xF0)) | (code << (4 * (c % 2))));
  else
    row[c] = code;
}
std::vector<float> dequantize(const Quantized& q);

// Largest |x| over n values (the NVFP4 tensor scale's input).
float abs_max(const float* x, int64_t n);

// One row of n values -> element values elems[n] and block scales scales[ceil(n/block)], such that
// value i is elems[i] * scales[i / block]. bf16 rounds elements and uses scale 1 per 32 elements.
// `tensor_scale` is NVFP4's (see nvfp4_tensor_scale); others ignore it.
void quantize_row_values(const float* x, int n, Format f, ScaleRule rule, float tensor_scale,
                         float* elems, float* scales);

// Block length that quantize_row_values uses for the scales of format f.
int value_block(Format f);

}  // namespace dmattn
