// Warpgroup-level tensor-core primitives (wgmma, sm_90a), written as PTX: the prefill kernel needs
// four instruction shapes and one shared-memory layout, so a 100-line header is the whole
// dependency (README, "Why raw PTX").
//
// Shared-memory operands are K-major tiles stored row by row (a row = one M or N index, its K
// elements contiguous) in the hardware's swizzled form: within each 8-row group the 16-byte chunks
// of a row are XOR-permuted by the row index, so the 8 rows' chunk c land in different banks.
// Row width W = 128 bytes (swizzle mode 1) or 64 bytes (mode 2); tiles start 1024-byte aligned.
//
// Accumulator layout (m64nN, fp32): warp w of the warpgroup, g = lane / 4, t = lane % 4; register
// i holds row 16w + g + 8*((i/2)%2), column 8*(i/4) + 2t + (i%2) — the mma.sync m16n8 C layout
// repeated along N, so acc[4*nt + e] reads like c[nt][e] there.
// A from registers (bf16, m64nNk16): warp w supplies rows 16w..16w+15 in the mma.sync m16n8k16 A
// layout (mma.cuh).
#pragma once
#include <cstdint>

namespace dmattn::cuda::wg {

// Byte offset of (row, byte) inside a swizzled K-major tile whose rows are W bytes.
template <int W>
__device__ __forceinline__ uint32_t swizzled(uint32_t row, uint32_t byte) {
  static_assert(W == 64 || W == 128);
  const uint32_t off = row * W + byte;
  return off ^ (((off >> 7) & (W / 16 - 1)) << 4);
}

// Matrix descriptor of a K-major swizzled tile starting at `smem`, as its two words: the low one holds
// the start address (>> 4) and LBO, the high one SBO (one 8-row group) and the swizzle mode. A byte
// offset (a multiple of 16: along K inside the swizzle atom, which the hardware resolves through the
// same XOR, or whole 8-row groups) adds to the address field only, and shared memory is < 256 KB, so
// that 14-bit field never carries: a descriptor built once before the loop costs each wgmma one add
// (rebuilt per wgmma it cost five uniform instructions, ~12% of a tile's instructions: ncu).
struct Desc {
  uint32_t lo, hi;
  __device__ __forceinline__ Desc operator+(uint32_t bytes) const { return {lo + (bytes >> 4), hi}; }
  __device__ __forceinline__ uint64_t u64() const { return uint64_t(hi) << 32 | lo; }
};
template <int W>
__device__ __forceinline__ Desc make_desc(const void* smem) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  const uint32_t mode = W == 128 ? 1 : 2;
  return {((addr & 0x3FFFF) >> 4) | (1u << 16), uint32_t((8 * W) >> 4) | (mode << 30)};
}
template <int W>
__device__ __forceinline__ uint64_t desc(const void* smem, uint32_t k_bytes = 0) {
  return (make_desc<W>(smem) + k_bytes).u64();
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Warp specialisation: a warpgroup gives registers back (producer) or takes them (consumers).
template <int R>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
// Named CTA barriers between some warps (id 0 is __syncthreads): sync waits for `threads` arrivals
// including its own warps'; arrive counts without waiting.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an in-flight wgmma.
template <int R>
__device__ __forceinline__ void pin(float (&acc)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}
// The same for A-operand registers of a wgmma in flight: pinned after its wait, they stay live (and
// their physical registers unused by other values) until the hardware has read them.
template <int R, int C>
__device__ __forceinline__ void pin(uint32_t (&regs)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int k = 0; k < C; ++k) asm volatile("" : "+r"(regs[i][k])::"memory");
}

#define DM_ACC8(o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7])
#define DM_OUT8(o) "=f"(d[o]), "=f"(d[o + 1]), "=f"(d[o + 2]), "=f"(d[o + 3]), "=f"(d[o + 4]), "=f"(d[o + 5]), "=f"(d[o + 6]), "=f"(d[o + 7])
#define DM_ACC32 DM_ACC8(0), DM_ACC8(8), DM_ACC8(16), DM_ACC8(24)
#define DM_OUT32 DM_OUT8(0), DM_OUT8(8), DM_OUT8(16), DM_OUT8(24)
#define DM_OUT64 DM_OUT32, DM_OUT8(32), DM_OUT8(40), DM_OUT8(48), DM_OUT8(56)
#define DM_ACC64 DM_ACC32, DM_ACC8(32), DM_ACC8(40), DM_ACC8(48), DM_ACC8(56)
#define DM_REGS32                                                                                                   \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29," \
  "%30,%31}"
#define DM_REGS64                                                                                                   \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29," \
  "%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,"    \
  "%57,%58,%59,%60,%61,%62,%63}"

// d (+)= A.B over K = 32 FP8 elements, A [64 x 32] and B [N x 32] in shared memory (both K-major).
// accumulate = false starts from zero. E5M2 when kE5M2, else E4M3 (both operands).
template <int N, bool kE5M2>
__device__ __forceinline__ void mma_fp8(float (&d)[N / 2], uint64_t a, uint64_t b, bool accumulate) {
  const int acc = accumulate ? 1 : 0;
  if constexpr (N == 128 && kE5M2)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e5m2 " DM_REGS64
                 ", %64, %65, p, 1, 1;\n}\n"
                 : DM_ACC64 : "l"(a), "l"(b), "r"(acc));
  else if constexpr (N == 128)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " DM_REGS64
                 ", %64, %65, p, 1, 1;\n}\n"
                 : DM_ACC64 : "l"(a), "l"(b), "r"(acc));
  else if constexpr (N == 64 && kE5M2)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k32.f32.e5m2.e5m2 " DM_REGS32
                 ", %32, %33, p, 1, 1;\n}\n"
                 : DM_ACC32 : "l"(a), "l"(b), "r"(acc));
  else {
    static_assert(N == 64);
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " DM_REGS32
                 ", %32, %33, p, 1, 1;\n}\n"
                 : DM_ACC32 : "l"(a), "l"(b), "r"(acc));
  }
}

// d (+)= A.B over K = 16 bf16 elements, A [64 x 16] and B [128 x 16] in shared memory (both K-major).
template <int N>
__device__ __forceinline__ void mma_bf16(float (&d)[N / 2], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(N == 128);
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DM_REGS64
               ", %64, %65, p, 1, 1, 0, 0;\n}\n"
               : DM_ACC64 : "l"(a), "l"(b), "r"(accumulate ? 1 : 0));
}

// d += A.B over K = 16 bf16 elements, A [64 x 16] from registers, B [N x 16] K-major in shared memory.
template <int N>
__device__ __forceinline__ void mma_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (N == 128)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DM_REGS64
                 ", {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
                 : DM_ACC64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  else {
    static_assert(N == 64);
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DM_REGS32
                 ", {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                 : DM_ACC32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
  }
}

// d (+)= A.B over K = 32 E4M3 elements, A [64 x 32] from registers (warp w supplies rows 16w..16w+15
// in the mma.sync m16n8k32 A layout: a[0] row g, k 4t..4t+3; a[1] row g+8; a[2], a[3] the same at
// k + 16) and B [N x 32] K-major in shared memory. kAcc = false starts from zero with d write-only
// ("=f"): a "+f" on a fresh accumulator makes ptxas keep its old values live for nothing.
template <int N, bool kAcc>
__device__ __forceinline__ void mma_fp8_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (N == 128 && kAcc)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " DM_REGS64
                 ", {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
                 : DM_ACC64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  else if constexpr (N == 128)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " DM_REGS64
                 ", {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
                 : DM_OUT64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  else if constexpr (kAcc)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " DM_REGS32
                 ", {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
                 : DM_ACC32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  else {
    static_assert(N == 64);
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " DM_REGS32
                 ", {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
                 : DM_OUT32 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
}

#undef DM_ACC8
#undef DM_ACC32
#undef DM_ACC64
#undef DM_OUT8
#undef DM_OUT32
#undef DM_OUT64
#undef DM_REGS32
#undef DM_REGS64

}  // namespace dmattn::cuda::wg
