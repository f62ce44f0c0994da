// Shared by the GPU tests: skip visibly (with the reason) where no CUDA device is present, and
// assert CUDA calls.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

namespace dmattn::test {
// Empty when a device is present; otherwise why not.
inline std::string no_device_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  return count > 0 ? std::string() : std::string("no CUDA device found");
}
}  // namespace dmattn::test

#define SKIP_WITHOUT_CUDA_DEVICE()                                                         \
  do {                                                                                     \
    const std::string why_ = dmattn::test::no_device_reason();                             \
    if (!why_.empty()) GTEST_SKIP() << "no CUDA device available (" << why_ << ")";        \
  } while (0)

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x
