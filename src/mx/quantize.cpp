#include "dmattn/quantize.hpp"

#include <algorithm>
#include <array>
#include <cmath>

#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn {

namespace {
constexpr std::array<FormatInfo, 7> kFormats{{
    {"mxfp8-e4m3", Elem::e4m3, 32, true, 8.25},
    {"mxfp8-e5m2", Elem::e5m2, 32, true, 8.25},
    {"mxfp6-e3m2", Elem::e3m2, 32, true, 6.25},
    {"mxfp6-e2m3", Elem::e2m3, 32, true, 6.25},
    {"mxfp4", Elem::e2m1, 32, true, 4.25},
    {"nvfp4", Elem::e2m1, kNvfp4Block, true, 4.5},
    {"bf16", Elem::e4m3, 32, false, 16.0},
}};
}  // namespace

FormatInfo format_info(Format f) { return kFormats.at(static_cast<size_t>(f)); }
std::string_view format_name(Format f) { return format_info(f).name; }

std::string format_names(bool quantized_only) {
  std::string s;
  for (const auto& fi : kFormats)
    if (fi.has_codes || !quantized_only) s += (s.empty() ? "" : "|") + std::string(fi.name);
  return s;
}

Format parse_format(std::string_view name) {
  if (name == "mxfp8") return Format::mxfp8_e4m3;
  for (size_t i = 0; i < kFormats.size(); ++i)
    if (kFormats[i].name == name) return Format(i);
  throw Error("unknown format '" + std::string(name) + "' (choose " + format_names() + ")");
}

std::string_view scale_rule_name(ScaleRule r) { return r == ScaleRule::ocp ? "ocp" : "ceil"; }

ScaleRule parse_scale_rule(std::string_view name) {
  if (name == "ocp") return ScaleRule::ocp;
  if (name == "ceil") return ScaleRule::ceil;
  throw Error("unknown scale rule '" + std::string(name) + "' (choose ocp|ceil)");
}

int value_block(Format f) { return format_info(f).block; }

int64_t Quantized::code_cols() const {
  return format_info(format).elem == Elem::e2m1 ? (cols + 1) / 2 : cols;
}
int64_t Quantized::scale_cols() const {
  const int b = format_info(format).block;
  return (cols + b - 1) / b;
}

float abs_max(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

namespace {
// Quantizes one block with the codec; returns its scale code.
uint8_t quantize_block(const float* v, int n, Format f, ScaleRule rule, float tensor_scale, uint8_t* codes) {
  const FormatInfo fi = format_info(f);
  return f == Format::nvfp4 ? quantize_nvfp4_block(v, n, tensor_scale, codes)
                            : quantize_mx_block(v, n, fi.elem, rule, codes);
}

float block_scale_value(Format f, uint8_t sc, float tensor_scale) {
  return f == Format::nvfp4 ? decode_elem(Elem::e4m3, sc) * tensor_scale : decode_e8m0(sc);
}
}  // namespace

Quantized quantize(const float* x, int64_t rows, int64_t cols, Format f, ScaleRule rule) {
  const FormatInfo fi = format_info(f);
  if (!fi.has_codes) throw Error("format " + std::string(fi.name) + " has no MX codes to write");
  Quantized q;
  q.format = f;
  q.rule = rule;
  q.rows = rows;
  q.cols = cols;
  if (f == Format::nvfp4) {
    const float amax = abs_max(x, rows * cols);
    if (!std::isfinite(amax)) throw Error("nvfp4: the tensor holds NaN or Inf");
    q.tensor_scale = nvfp4_tensor_scale(amax);
  }
  const int64_t cc = q.code_cols(), sc = q.scale_cols();
  q.codes.assign(size_t(rows * cc), 0);
  q.scales.assign(size_t(rows * sc), 0);
  const bool pack = fi.elem == Elem::e2m1;
  std::vector<uint8_t> codes(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    for (int64_t b = 0; b < sc; ++b) {
      const int64_t c0 = b * fi.block;
      const int n = int(std::min<int64_t>(fi.block, cols - c0));
      q.scales[size_t(r * sc + b)] = quantize_block(xr + c0, n, f, rule, q.tensor_scale, codes.data() + c0);
    }
    uint8_t* out = q.codes.data() + r * cc;
    for (int64_t c = 0; c < cols; ++c) set_element_code(out, c, pack, codes[size_t(c)]);
  }
  return q;
}

std::vector<float> dequantize(const Quantized& q) {
  const FormatInfo fi = format_info(q.format);
  if (!fi.has_codes) throw Error("format " + std::string(fi.name) + " has no MX codes to read");
  const int64_t cc = q.code_cols(), sc = q.scale_cols();
  if (int64_t(q.codes.size()) != q.rows * cc || int64_t(q.scales.size()) != q.rows * sc)
    throw Error("dequantize: codes or scales do not match the shape");
  const bool pack = fi.elem == Elem::e2m1;
  std::vector<float> out(size_t(q.rows * q.cols));
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const uint8_t code = element_code(q.codes.data() + r * cc, c, pack);
      const float s = block_scale_value(q.format, q.scales[size_t(r * sc + c / fi.block)], q.tensor_scale);
      out[size_t(r * q.cols + c)] = decode_elem(fi.elem, code) * s;
    }
  }
  return out;
}

void quantize_row_values(const float* x, int n, Format f, ScaleRule rule, float tensor_scale, float* elems,
                         float* scales) {
  const FormatInfo fi = format_info(f);
  uint8_t codes[32];
  for (int b = 0, c0 = 0; c0 < n; ++b, c0 += fi.block) {
    const int len = std::min(fi.block, n - c0);
    if (!fi.has_codes) {
      for (int i = 0; i < len; ++i) elems[c0 + i] = round_bf16(x[c0 + i]);
      scales[b] = 1.0f;
      continue;
    }
    const uint8_t sc = quantize_block(x + c0, len, f, rule, tensor_scale, codes);
    scales[b] = block_scale_value(f, sc, tensor_scale);
    for (int i = 0; i < len; ++i) elems[c0 + i] = decode_elem(fi.elem, codes[i]);
  }
}

}  // namespace dmattn
