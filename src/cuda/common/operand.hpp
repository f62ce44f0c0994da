// The form a tile format's Q and K rows take on Hopper's tensor cores, which have FP8 and bf16 MMAs
// but no block-scaled or 4-bit one. A tile's format is chosen per key tile at run time (the policy's
// high and low slots alternate along a row), so the kernel holds each slot's form in a register and
// branches once a tile into code instantiated per form (OperandTraits).
#pragma once
#include <cstdint>

#include "dmattn/format.hpp"

namespace dmattn::cuda {

enum class Operand : uint8_t {
  e4m3,  // one E4M3 byte an element: every MX element format whose values E4M3 holds exactly
  e5m2,  // one E5M2 byte an element: MXFP8 E5M2
  bf16,  // bf16 values with their block scales folded in: NVFP4 (E2M1 times E4M3 has <= 6 significant bits)
};

template <Operand>
struct OperandTraits;
template <>
struct OperandTraits<Operand::e4m3> {
  static constexpr bool kFp8 = true, kE5M2 = false;
};
template <>
struct OperandTraits<Operand::e5m2> {
  static constexpr bool kFp8 = true, kE5M2 = true;
};
template <>
struct OperandTraits<Operand::bf16> {
  static constexpr bool kFp8 = false, kE5M2 = false;
};

// The one table from tile format to tensor-core form (a new element format: one row here plus its
// codec). bf16 tiles are not a form of the CUDA prefill (its capabilities refuse them first).
constexpr Operand operand_of(Format f) {
  switch (f) {
    case Format::mxfp8_e5m2: return Operand::e5m2;
    case Format::nvfp4: return Operand::bf16;
    default: return Operand::e4m3;  // mxfp8-e4m3, mxfp6-e3m2, mxfp6-e2m3, mxfp4
  }
}

// The FP8 element type of an FP8 form's bytes.
constexpr Elem mma_elem(Format f) { return operand_of(f) == Operand::e5m2 ? Elem::e5m2 : Elem::e4m3; }

}  // namespace dmattn::cuda
