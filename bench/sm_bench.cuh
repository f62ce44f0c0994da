// Shared by the benches that run one CTA an SM on every SM and read clock64 cycles per warpgroup
// (bench_wgmma_cuda, bench_chains_cuda): the device set-up, a warmed-up timed launch, the read-back.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cuda/common/buffers.hpp"

struct SmBench {
  int sms = 0;
  long long* cycles = nullptr;  // `slots` a CTA, written by the kernels
  int slots = 0;

  // false (with a message) where there is no usable device.
  bool init(int slots_per_cta) {
    slots = slots_per_cta;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    if (sms <= 0 || cudaMalloc(&cycles, sizeof(long long) * slots * sms) != cudaSuccess) {
      std::fprintf(stderr, "no usable CUDA device\n");
      return false;
    }
    return true;
  }
  // Milliseconds of one launch after a warm-up launch (clocks up); launch() enqueues the kernel.
  template <class Launch>
  float time_ms(Launch launch) {
    launch();
    return dmattn::cuda::time_ms(launch);
  }
  std::vector<long long> read() const {
    std::vector<long long> h(size_t(slots) * sms);
    cudaMemcpy(h.data(), cycles, sizeof(long long) * h.size(), cudaMemcpyDeviceToHost);
    return h;
  }
  // main()'s exit code: 1 where a launch failed.
  static int status() {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(err));
      return 1;
    }
    return 0;
  }
};
