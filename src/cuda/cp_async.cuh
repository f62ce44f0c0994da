// cp.async (sm_80+): global->shared copies that bypass registers, grouped and awaited in order.
// Shared by the prefill and decode kernels' multi-stage pipelines.
#pragma once
#include <cstdint>

namespace dmattn::cuda {

// 16-byte copy to a shared-memory address; zero-fills the destination when `valid` is false (the
// source is not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid = true) {
  cp_async16(uint32_t(__cvta_generic_to_shared(dst)), src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

}  // namespace dmattn::cuda
