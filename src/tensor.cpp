#include "dmattn/tensor.hpp"

#include <cstring>
#include <type_traits>

#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn {

size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    default: return "bfloat16";
  }
}

TensorView TensorView::contiguous(void* data, DType dtype, Shape shape, Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.shape = shape;
  t.stride = {shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1};
  return t;
}

std::string shape_str(const Shape& s) {
  return "[" + std::to_string(s[0]) + "," + std::to_string(s[1]) + "," + std::to_string(s[2]) + "," +
         std::to_string(s[3]) + "]";
}

void load_row(const TensorView& t, int64_t b, int64_t h, int64_t n, float* dst) {
  const int64_t d = t.shape[3], base = t.offset(b, h, n, 0), s = t.stride[3];
  with_typed(t, [&](auto* p) {
    for (int64_t i = 0; i < d; ++i) dst[i] = to_float(p[base + i * s]);
  });
}

void store_row(const TensorView& t, int64_t b, int64_t h, int64_t n, const float* src) {
  const int64_t d = t.shape[3], base = t.offset(b, h, n, 0), s = t.stride[3];
  with_typed(t, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (int64_t i = 0; i < d; ++i) p[base + i * s] = from_float<T>(src[i]);
  });
}

HostTensor::HostTensor(DType dtype, Shape shape) : dtype_(dtype), shape_(shape) {
  for (int64_t x : shape)
    if (x < 0) throw Error("negative tensor dimension in " + shape_str(shape));
  bytes_.assign(size_t(numel()) * dtype_size(dtype), std::byte{0});
}

HostTensor HostTensor::from_floats(const std::vector<float>& v, Shape shape, DType dtype) {
  HostTensor t(dtype, shape);
  if (int64_t(v.size()) != t.numel()) throw Error("from_floats: size does not match " + shape_str(shape));
  const TensorView tv = t.view();
  const int64_t d = shape[3];
  for (int64_t b = 0; b < shape[0]; ++b)
    for (int64_t h = 0; h < shape[1]; ++h)
      for (int64_t n = 0; n < shape[2]; ++n) store_row(tv, b, h, n, v.data() + ((b * shape[1] + h) * shape[2] + n) * d);
  return t;
}

HostTensor HostTensor::copy_of(const TensorView& t, DType dtype) {
  HostTensor h(dtype, t.shape);
  const TensorView hv = h.view();
  std::vector<float> row(static_cast<size_t>(t.shape[3]));
  for (int64_t b = 0; b < t.shape[0]; ++b)
    for (int64_t hh = 0; hh < t.shape[1]; ++hh)
      for (int64_t n = 0; n < t.shape[2]; ++n) {
        load_row(t, b, hh, n, row.data());
        store_row(hv, b, hh, n, row.data());
      }
  return h;
}

std::vector<float> HostTensor::to_floats() const {
  std::vector<float> v(static_cast<size_t>(numel()));
  const TensorView tv = view();
  const int64_t d = shape_[3];
  for (int64_t b = 0; b < shape_[0]; ++b)
    for (int64_t h = 0; h < shape_[1]; ++h)
      for (int64_t n = 0; n < shape_[2]; ++n) load_row(tv, b, h, n, v.data() + ((b * shape_[1] + h) * shape_[2] + n) * d);
  return v;
}

TensorView slice_tokens(const TensorView& t, int64_t n0, int64_t n) {
  if (n0 < 0 || n < 0 || n0 + n > t.shape[2]) throw Error("slice_tokens: rows out of range");
  TensorView v = t;
  v.data = static_cast<std::byte*>(t.data) + n0 * t.stride[2] * int64_t(dtype_size(t.dtype));
  v.shape[2] = n;
  return v;
}

}  // namespace dmattn
