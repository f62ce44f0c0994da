// Warp-level helpers: the FP8 block dot (two f16 mma.sync on operands widened exactly to f16, as ptxas
// runs FP8 mma.sync on sm_90; GpuMma measures its precision), the integer block dot, the
// fragment layouts the wgmma kernel's registers follow, and per-element intrinsics.
// Fragment layouts (PTX ISA, m16n8k32 8-bit and m16n8k16 16-bit): g = lane / 4, t = lane % 4;
//   A 16x32 fp8: a[0] = (row g, k 4t..4t+3), a[1] = (row g+8, same k), a[2] = (row g, k 16+4t..),
//                a[3] = (row g+8, k 16+4t..); B 32x8: b[0] = (k 4t..4t+3, col g), b[1] = (k 16+4t.., col g)
//   A 16x16 bf16: a[0] = (row g, k 2t,2t+1), a[1] = (row g+8), a[2] = (row g, k 8+2t..), a[3] = (row g+8, k 8+2t..)
//                 B 16x8: b[0] = (k 2t,2t+1, col g), b[1] = (k 8+2t.., col g)
//   C 16x8 fp32: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g+8, cols 2t, 2t+1)
#pragma once
#include <cstdint>

#include "cuda/ptx/fp8.cuh"

namespace dmattn::cuda {

// d = A.B + c for one 32-wide block in integers: A unsigned bytes, B signed bytes, int32 sums (exact;
// sm_90 runs this mma natively, IMMA). The decode's E2M1 pages take this path (cuda/e2m1_bytes.hpp).
__device__ __forceinline__ void mma_u8s8_block(int d[4], const uint32_t a[4], uint32_t b0, uint32_t b1, const int c[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

// d += A.B for a 16x8 tile over 16 contraction slots in bf16 or f16, fp32 accumulate.
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = A.B for one 32-wide contraction block (one MX block) of FP8 operands in the m16n8k32 layout,
// into a fresh accumulator. sm_90 has no FP8 mma.sync: ptxas widens both operands to f16 (exact) and
// issues two m16n8k16 f16 mmas, then adds the given zero accumulator with one FADD an element (it
// must: -0 + 0 is +0). Written out here, the mmas start from zero and there is no FADD (32 a page in the
// decode's P.V). An FP8 register's slots 4t..4t+3 become the f16 slots 2t, 2t+1 (low half) and 8+2t,
// 9+2t (high half) of one m16n8k16: a permutation of the contraction, the same in A and B.
// d = A.B over 32 contraction slots in f16 as two m16n8k16 mmas from zero: a1, b[0..1] the first 16
// slots, a2, b[2..3] the next 16.
__device__ __forceinline__ void mma_f16_block(float d[4], const uint32_t (&a1)[4], const uint32_t (&a2)[4], const uint32_t (&b)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = 0.0f;
  mma_16816<false>(d, a1, b[0], b[1]);
  mma_16816<false>(d, a2, b[2], b[3]);
}

// An FP8 A fragment of m16n8k32 (a[0..3]) widened exactly to the two m16n8k16 f16 fragments of the same
// 32 slots, in the slot order mma_fp8_block's B words take: a1 the low halves, a2 the high ones.
template <bool kE5M2>
__device__ __forceinline__ void fp8_a_to_f16(const uint32_t a[4], uint32_t (&a1)[4], uint32_t (&a2)[4]) {
  auto lo = [](uint32_t x) { return fp8x2_to_f16x2<kE5M2>(x); };
  auto hi = [](uint32_t x) { return fp8x2_to_f16x2<kE5M2>(hi16(x)); };
  a1[0] = lo(a[0]), a1[1] = lo(a[1]), a1[2] = hi(a[0]), a1[3] = hi(a[1]);
  a2[0] = lo(a[2]), a2[1] = lo(a[3]), a2[2] = hi(a[2]), a2[3] = hi(a[3]);
}

template <bool kE5M2>
__device__ __forceinline__ void mma_fp8_block(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  uint32_t a1[4], a2[4];
  fp8_a_to_f16<kE5M2>(a, a1, a2);
  const uint32_t b[4] = {fp8x2_to_f16x2<kE5M2>(b0), fp8x2_to_f16x2<kE5M2>(hi16(b0)), fp8x2_to_f16x2<kE5M2>(b1),
                         fp8x2_to_f16x2<kE5M2>(hi16(b1))};
  mma_f16_block(d, a1, a2, b);
}

// Four 8x8 b16 matrices from shared memory, transposed: lanes 8i..8i+7 give the row addresses of
// matrix i; r[i] receives, in lane (g, t), matrix i's elements (rows 2t and 2t+1, column g): the
// B fragment of m16n8k16 when the matrix rows are keys and its columns are V's columns.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row_addr) {
  const uint32_t a = uint32_t(__cvta_generic_to_shared(row_addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Two floats rounded to bf16 (nearest-even, as to_bf16) in one instruction; lo in the low half.
__device__ __forceinline__ uint32_t bf16x2_rn(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The same to f16 (nearest-even, overflow to inf, subnormals kept).
__device__ __forceinline__ uint32_t f16x2_rn(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// f16x2 arithmetic a kOp b (kOp '+', '-' or '*'), round to nearest, subnormals kept (no .ftz), never
// contracted: the quantize pass's fold and E2M1 rounding, the decode's P scaling.
template <char kOp>
__device__ __forceinline__ uint32_t h2_rn(uint32_t a, uint32_t b) {
  static_assert(kOp == '+' || kOp == '-' || kOp == '*');
  uint32_t d;
  if constexpr (kOp == '+')
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else if constexpr (kOp == '-')
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 2^x on the special-function unit (flushes subnormal results to zero; 2^-inf = 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

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
