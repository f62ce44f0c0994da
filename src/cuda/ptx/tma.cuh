// Hopper's asynchronous copy engine (TMA) and the transaction barriers (mbarrier) that say when its
// copies have landed: the producer side of a warp-specialised pipeline. Written as PTX for the same
// reason as wgmma.cuh (a handful of instructions; README, "Why raw PTX").
#pragma once
#include <cuda.h>

#include <cstdint>

namespace dmattn::cuda {

// A tiled tensor map over a 3-D tensor (dims[0] contiguous, strides in bytes for dims 1 and 2),
// boxes of box[0..2] elements, the given shared-memory swizzle, zero fill outside the tensor.
// Throws dmattn::Error when the driver refuses it.
CUtensorMap tensor_map_3d(const void* base, CUtensorMapDataType type, const uint64_t (&dims)[3],
                          const uint64_t (&strides)[2], const uint32_t (&box)[3], CUtensorMapSwizzle swizzle);

namespace tma {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialised barriers visible to the async proxy (TMA) and the other threads (after a CTA barrier).
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// Orders this thread's earlier generic-proxy accesses to shared memory before later copies (async
// proxy) into the same bytes: shared memory written by threads and then refilled by TMA.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrives and announces `bytes` of copies that complete the current phase when they land.
__device__ __forceinline__ void arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Blocks until the barrier's phase of the given parity has completed. The suspend-time hint lets the
// hardware park the warp until the phase completes (or ~10 ms pass) instead of returning at once: a
// bare try_wait loop spun 270 times a tile in the producer (137 M instructions at N = 16384, 9% of
// the kernel's, all on one scheduler of each SM; ncu).
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity), "r"(10000000u)
        : "memory");
  } while (!done);
}

// One box of a 3-D tensor map at element coordinates (c0, c1, c2) into shared memory.
__device__ __forceinline__ void load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}
// A contiguous copy (16-byte aligned ends, a multiple of 16 bytes).
__device__ __forceinline__ void load_bytes(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

}  // namespace tma
}  // namespace dmattn::cuda
