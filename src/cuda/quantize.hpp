// GPU quantization of [B,H,N,d] rows into MX codes + E8M0 scales, bit-identical to the CPU codec
// (same header). One pass reads each element once and writes one or two formats (e.g. the high
// and the low format of K), so DMA's K/V preparation costs one read of the tensor.
#pragma once
#include <cuda_runtime.h>

#include "dmattn/format.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn::cuda {

struct QuantTarget {
  Format format = Format::mxfp4;
  uint8_t* codes = nullptr;   // [rows, d] bytes, or [rows, d/2] for E2M1 (two per byte, low nibble first)
  uint8_t* scales = nullptr;  // [rows, d/32]
  // Tensor-core form: one byte per element, the element's value as an FP8 byte (E5M2 for mxfp8-e5m2,
  // E4M3 for every other element format, which it holds exactly), ready for FP8 MMA.
  bool fp8_bytes = false;
};

// The FP8 element type a format's values take in the tensor-core form.
inline Elem mma_elem(Format f) { return f == Format::mxfp8_e5m2 ? Elem::e5m2 : Elem::e4m3; }

// x: a CUDA tensor view with unit stride on its last axis and d a multiple of 32. Rows are ordered
// (b, h, n). `second` may have null pointers (one format only). MX formats only: NVFP4 needs a
// tensor-wide amax first and throws dmattn::Error here. Asynchronous on `stream`.
void quantize_rows(const TensorView& x, ScaleRule rule, const QuantTarget& first, const QuantTarget& second,
                   cudaStream_t stream);

}  // namespace dmattn::cuda
