// GPU quantization of [B,H,N,d] rows into MX codes + E8M0 scales, bit-identical to the CPU codec
// (same header). One pass reads each element once and writes one or two formats (e.g. the high
// and the low format of K), so DMA's K/V preparation costs one read of the tensor.
#pragma once
#include <cuda_runtime.h>

#include "cuda/common/operand.hpp"
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
  // With fp8_bytes: where it is exact, fold a row's block scales into its codes (each block's
  // values shifted by 2^(its scale - the row's largest), the FP8 bytes holding them exactly) and
  // give every block of the row the largest scale. The values code x scale are unchanged; a row
  // whose scales all agree lets the kernel run all of d as one MMA chain with one scale per row
  // (docs/DESIGN.md). Rows where a shifted value would round keep their own scales (but see round_fold).
  bool fold = false;
  // Optional, for the prefill kernel: per row, the row's one scale as a float when all its blocks
  // share it (else -1), in [B*H][row_pad] (row_pad a multiple of 128, zeros past N are the
  // caller's); and per 128-row tile of each (b, h), set nonzero where some row has no single scale
  // (the caller zeroes the array first: one memset with the row scales). With row_scale set,
  // `scales` is padded the same way: [B*H][row_pad][d/32], so a tile's block scales are one aligned
  // run of bytes.
  float* row_scale = nullptr;
  int64_t row_pad = 0;
  int* tile_split = nullptr;
  // With fold, for MXFP8 (E4M3, E5M2): fold also the rows whose block scales span at most 2^8 where
  // a shifted value falls below the FP8 type's subnormal step (E4M3 2^-9, E5M2 2^-16, in units of the
  // row's largest scale): it rounds to that step (nearest-even). An element then moves by at most
  // half a step, 2^-10 of the row's scale for E4M3: under 2^-17.8 of the row's largest magnitude, which
  // the scale rule puts above 2^7.8 row scales (the FP8 tensor cores' own sums keep about 13 bits).
  // The codes and scales stay the codec's where no value rounds. The prefill takes it: a row of one
  // scale runs all of d as one MMA chain instead of a promotion per 32-block.
  bool round_fold = false;
};

// The accuracy transforms a quantize pass applies to each row as it reads it (the prefill's fast
// path for Policy::rotate and smooth_k): the randomized Hadamard rotation (dmattn/rotation.hpp; d a
// power of two up to 256, or blocks of its largest power-of-two divisor), then minus sub[b*H + h]
// (a [B*H][d] vector, smooth_k's or smooth_q's mean; see PackedRows), then rounded to bf16 -- the
// oracle's transformed rows.
struct RowTransform {
  bool on = false;
  bool rotate = false;
  const float* sub = nullptr;
  // sub for the first target alone (smooth_q=high: the high tiles' queries centred, the low tiles' not).
  bool sub_first = false;
};

// Packed sequences' K (the prefill's K form only, both targets): input row n of each (b, h) goes to
// padded row slot[n] < row_pad, codes included ([B*H][row_pad][d] then), so each sequence's rows
// start a 128-row tile of their own (rows no input row maps to are the caller's); with a
// RowTransform's sub, row n subtracts sub[seq[n] * heads + h], its sequence's mean.
struct PackedRows {
  const int32_t* slot = nullptr;
  const int32_t* seq = nullptr;
  int heads = 0;
};

// Whether every row start of x ([B,H,N,d], unit stride on d) is 16-byte aligned: vector loads.
inline bool rows_16byte_aligned(const TensorView& x) {
  const int64_t es = int64_t(dtype_size(x.dtype));
  return reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && (x.stride[0] * es) % 16 == 0 &&
         (x.stride[1] * es) % 16 == 0 && (x.stride[2] * es) % 16 == 0;
}

// x: a CUDA tensor view with unit stride on its last axis and d a multiple of 32. Rows are ordered
// (b, h, n). `second` may have null pointers (one format only). MX formats only: NVFP4 needs a
// tensor-wide amax first and throws dmattn::Error here. Asynchronous on `stream`. With `nonfinite`,
// sets *nonfinite = 1 where a value is NaN or Inf (the block's scale is the NaN scale either way),
// so callers need no separate scan of the input.
void quantize_rows(const TensorView& x, ScaleRule rule, const QuantTarget& first, const QuantTarget& second,
                   cudaStream_t stream, int* nonfinite = nullptr, const RowTransform& transform = {},
                   const PackedRows& packed = {});

// NVFP4 in the prefill's tensor-core form (docs/DESIGN.md): per row one fp32 second scale from the
// row's amax (nvfp4_tensor_scale), per 16-block an E4M3 scale, each element's E2M1 value times its
// block's scale as bf16 (at most 6 significant bits: exact), from the CPU codec's own encoder (the
// same header). One launch. values: [rows, d] bf16, 16-byte aligned; row_scale: [B*H][row_pad] the
// rows' second scales (row_pad >= N); optional: scales, the E4M3 codes as [B*H][row_pad][d/16], and
// tile_scale [B*H][row_pad/128] (row_pad a multiple of 128) set to 0: the prefill kernel's "one scale
// a key" (its per-key scales then come from row_scale). Sets *nonfinite = 1 on NaN/Inf. Asynchronous
// on `stream`. x: a CUDA tensor view with unit stride on d, d/16 a power of two up to 32.
struct Nvfp4Target {
  uint16_t* values = nullptr;
  uint8_t* scales = nullptr;
  int64_t row_pad = 0;
  float* row_scale = nullptr;
  float* tile_scale = nullptr;
};
void quantize_rows_nvfp4(const TensorView& x, const Nvfp4Target& t, cudaStream_t stream, int* nonfinite = nullptr);

// The prefill pre-pass's second step, on K's tensor-core form after quantize_rows (fold + row
// scales): per 128-key tile of each (b, h) whose keys each carry one scale (tile_split 0), shift every
// key's FP8 bytes to the tile's largest key scale where that is exact for every key of the tile,
// rewriting codes, block scales and row scales to match (values unchanged), and record the tile's
// scale in tile_scale [B*H][row_pad/128] (0 where the tile keeps one scale a key, -1 where some key
// keeps several: the prefill kernel's one per-tile read says both). The prefill kernel
// then folds one scale per tile into its exponent instead of multiplying S by 128 key scales: MXFP4
// keys fold whenever their scales span at most 2^8. codes: [B*H*N, d] bytes, E5M2 bytes when e5m2.
// Several K forms (the policy's two formats) in one launch where their byte types agree.
struct KeyFold {
  uint8_t* codes;
  uint8_t* scales;
  float* row_scale;
  const int* tile_split;
  float* tile_scale;
  bool e5m2;
};
void fold_key_tiles(const KeyFold* folds, int count, int64_t BH, int64_t N, int64_t row_pad, int64_t d,
                    cudaStream_t stream);

}  // namespace dmattn::cuda
