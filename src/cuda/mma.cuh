// Warp-level tensor-core primitives (mma.sync, sm_89+), named for the math they do.
// Fragment layouts (PTX ISA, m16n8k32 8-bit and m16n8k16 16-bit): g = lane / 4, t = lane % 4;
//   A 16x32 fp8: a[0] = (row g, k 4t..4t+3), a[1] = (row g+8, same k), a[2] = (row g, k 16+4t..),
//                a[3] = (row g+8, k 16+4t..); B 32x8: b[0] = (k 4t..4t+3, col g), b[1] = (k 16+4t.., col g)
//   A 16x16 bf16: a[0] = (row g, k 2t,2t+1), a[1] = (row g+8), a[2] = (row g, k 8+2t..), a[3] = (row g+8, k 8+2t..)
//                 B 16x8: b[0] = (k 2t,2t+1, col g), b[1] = (k 8+2t.., col g)
//   C 16x8 fp32: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g+8, cols 2t, 2t+1)
#pragma once
#include <cstdint>

namespace dmattn::cuda {

// d = A.B for one 32-wide contraction block (one MX block) into a fresh accumulator.
template <bool kE5M2>
__device__ __forceinline__ void mma_fp8_block(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (kE5M2) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e5m2.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  }
}

// c += A.B, bf16 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_bf16_acc(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory, transposed. Lane L addresses row L % 16 of a 16-row
// slice of a row-major [k][n] tile, at column offset (L / 16) * 8: then {r[0], r[1]} and
// {r[2], r[3]} are the m16n8k16 B fragments of the two adjacent n8 column blocks.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* smem_row) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t pack_bf16(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// Max and sum over the 4 lanes that share a row of a C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace dmattn::cuda
