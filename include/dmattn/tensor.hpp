// Non-owning 4-D tensor views ([B, H, N, d], strides in elements) and a small owning host tensor.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dmattn/numeric.hpp"

namespace dmattn {

enum class DType : uint8_t { f32, f16, bf16 };
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);

using Shape = std::array<int64_t, 4>;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  Shape shape{};
  Shape stride{};  // in elements

  static TensorView contiguous(void* data, DType dtype, Shape shape, Device device = Device::cpu);
  int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  int64_t offset(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3];
  }
};

std::string shape_str(const Shape& s);

// Calls f with the view's data pointer typed by its dtype (float*, fp16* or bf16*): the one place
// a dtype becomes a C++ type, for loops and kernel launches alike.
template <class F>
decltype(auto) with_typed(const TensorView& t, F&& f) {
  switch (t.dtype) {
    case DType::f16: return f(static_cast<fp16*>(t.data));
    case DType::bf16: return f(static_cast<bf16*>(t.data));
    case DType::f32: break;
  }
  return f(static_cast<float*>(t.data));
}

// Rows [n0, n0 + n) of the third axis (tokens) of a [B, H, N, d] view: a view, no copy.
TensorView slice_tokens(const TensorView& t, int64_t n0, int64_t n);

// Reads one row (the last axis, length shape[3]) of a CPU view as float.
void load_row(const TensorView& t, int64_t b, int64_t h, int64_t n, float* dst);
// Writes one row of a CPU view from float, rounding to its dtype (nearest-even).
void store_row(const TensorView& t, int64_t b, int64_t h, int64_t n, const float* src);

// An owning, contiguous host tensor.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Shape shape);
  static HostTensor from_floats(const std::vector<float>& v, Shape shape, DType dtype = DType::f32);
  // A contiguous copy of a (possibly strided) CPU view, converted to `dtype`.
  static HostTensor copy_of(const TensorView& t, DType dtype = DType::f32);

  TensorView view() { return TensorView::contiguous(bytes_.data(), dtype_, shape_); }
  TensorView view() const { return TensorView::contiguous(const_cast<std::byte*>(bytes_.data()), dtype_, shape_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_[0] * shape_[1] * shape_[2] * shape_[3]; }
  std::byte* bytes() { return bytes_.data(); }
  const std::byte* bytes() const { return bytes_.data(); }
  size_t nbytes() const { return bytes_.size(); }
  std::vector<float> to_floats() const;

 private:
  DType dtype_ = DType::f32;
  Shape shape_{};
  std::vector<std::byte> bytes_;
};

}  // namespace dmattn
