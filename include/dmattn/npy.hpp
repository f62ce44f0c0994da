// NumPy .npy files (format versions 1.0-3.0), little-endian, C order.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dmattn/tensor.hpp"

namespace dmattn {

enum class NpyType : uint8_t { f32, f16, u8 };

struct NpyArray {
  NpyType type = NpyType::f32;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;  // raw little-endian elements
  int64_t numel() const;
};

// Throws dmattn::Error naming the file and the problem (missing, bad magic, bad header, dtype,
// Fortran order, truncated data).
NpyArray read_npy(const std::string& path);
void write_npy(const std::string& path, NpyType type, const std::vector<int64_t>& shape, const void* data);

// A 4-D float32/float16 array as a host tensor; `what` names it in errors ("--q").
HostTensor read_npy_tensor(const std::string& path, const std::string& what);
std::vector<float> npy_to_floats(const NpyArray& a);

}  // namespace dmattn
