// Kernel launches that may be a programmatic dependent of the stream's previous kernel (ptx/pdl.cuh):
// its CTAs are placed while that kernel finishes, hiding the launch latency in a chain of short
// kernels. Such a kernel calls wait_prior_grids() before it reads anything an earlier kernel wrote.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "cuda/common/buffers.hpp"

namespace dmattn::cuda {

template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool dependent,
                   const char* what, Args&&... args) {
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &pdl;
  cfg.numAttrs = dependent ? 1 : 0;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
}

}  // namespace dmattn::cuda
