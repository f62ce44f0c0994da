// `dmattn quantize` / `dmattn dequantize`: MX codes along the last axis of an array.
#include <cstdio>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "dmattn/npy.hpp"
#include "dmattn/quantize.hpp"

namespace dmattn::cli {

namespace {
struct Args {
  std::string format = "mxfp4", rule = "ocp", in, codes, scales, tensor_scale, out;
  int64_t cols = 0;
};

void add_common(CLI::App* cmd, Args& a) {
  cmd->add_option("--format", a.format, "element format (" + format_names(/*quantized_only=*/true) + ")")->capture_default_str();
  cmd->add_option("--codes", a.codes, "element codes, uint8 (E2M1: two per byte, low nibble first)")->required();
  cmd->add_option("--scales", a.scales, "block scales, uint8 (E8M0; E4M3 for nvfp4)")->required();
  cmd->add_option("--tensor-scale", a.tensor_scale, "nvfp4 per-tensor fp32 scale, a 1-element float32 .npy");
}

// The rows x cols view of an array quantized along its last axis.
std::pair<int64_t, int64_t> rows_cols(const std::vector<int64_t>& shape, const std::string& what) {
  if (shape.empty()) throw Error(what + ": need at least one dimension");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return {rows, shape.back()};
}
}  // namespace

void add_quantize(CLI::App& app) {
  auto q = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("quantize", "float32/float16 .npy -> MX codes + scales (blocks along the last axis)");
  add_common(cmd, *q);
  cmd->add_option("--in", q->in, "input array")->required();
  cmd->add_option("--scale-rule", q->rule, "shared-exponent rule (ocp|ceil)")->capture_default_str();
  cmd->callback([q] {
    const Format f = parse_format(q->format);
    if (!format_info(f).has_codes) throw Error("--format " + q->format + " has no codes to write (choose " + format_names(true) + ")");
    check_outputs({{"--codes", q->codes}, {"--scales", q->scales}, {"--tensor-scale", q->tensor_scale}});
    if (f == Format::nvfp4 && q->tensor_scale.empty()) throw Error("nvfp4 needs --tensor-scale to store its per-tensor scale");
    const NpyArray in = read_npy(q->in);
    if (in.type == NpyType::u8) throw Error(q->in + ": uint8 input; need float32 or float16");
    const auto [rows, cols] = rows_cols(in.shape, q->in);
    const std::vector<float> x = npy_to_floats(in);
    const Quantized qz = quantize(x.data(), rows, cols, f, parse_scale_rule(q->rule));
    std::vector<int64_t> cshape = in.shape, sshape = in.shape;
    cshape.back() = qz.code_cols();
    sshape.back() = qz.scale_cols();
    write_npy(q->codes, NpyType::u8, cshape, qz.codes.data());
    write_npy(q->scales, NpyType::u8, sshape, qz.scales.data());
    if (f == Format::nvfp4) write_npy(q->tensor_scale, NpyType::f32, {1}, &qz.tensor_scale);
    std::printf("quantize: %lld rows x %lld values in %s -> %s, %s%s\n", (long long)rows, (long long)cols,
                std::string(format_name(f)).c_str(), q->codes.c_str(), q->scales.c_str(),
                f == Format::nvfp4 ? (", " + q->tensor_scale).c_str() : "");
  });

  auto d = std::make_shared<Args>();
  CLI::App* dcmd = app.add_subcommand("dequantize", "MX codes + scales -> float32 .npy (the inverse of quantize)");
  add_common(dcmd, *d);
  dcmd->add_option("--out", d->out, "output float32 array")->required();
  dcmd->add_option("--cols", d->cols, "length of the last axis (default: from the codes; needed for odd E2M1 lengths)");
  dcmd->callback([d] {
    check_outputs({{"--out", d->out}});
    Quantized qz;
    qz.format = parse_format(d->format);
    const NpyArray codes = read_npy(d->codes), scales = read_npy(d->scales);
    if (codes.type != NpyType::u8 || scales.type != NpyType::u8) throw Error("codes and scales must be uint8 arrays");
    const auto [rows, ccols] = rows_cols(codes.shape, d->codes);
    const bool packed = format_info(qz.format).elem == Elem::e2m1 && format_info(qz.format).has_codes;
    qz.rows = rows;
    qz.cols = d->cols > 0 ? d->cols : (packed ? 2 * ccols : ccols);
    if (qz.code_cols() != ccols) throw Error("--cols " + std::to_string(qz.cols) + " does not match the codes' last axis");
    const auto [srows, scols] = rows_cols(scales.shape, d->scales);
    if (srows != rows || scols != qz.scale_cols())
      throw Error(d->scales + ": expected " + std::to_string(rows) + " rows of " + std::to_string(qz.scale_cols()) + " scales");
    if (qz.format == Format::nvfp4) {
      if (d->tensor_scale.empty()) throw Error("nvfp4 needs --tensor-scale");
      const NpyArray ts = read_npy(d->tensor_scale);
      if (ts.type != NpyType::f32 || ts.numel() != 1) throw Error(d->tensor_scale + ": expected one float32");
      qz.tensor_scale = npy_to_floats(ts)[0];
    }
    qz.codes.assign(reinterpret_cast<const uint8_t*>(codes.data.data()),
                    reinterpret_cast<const uint8_t*>(codes.data.data()) + codes.data.size());
    qz.scales.assign(reinterpret_cast<const uint8_t*>(scales.data.data()),
                     reinterpret_cast<const uint8_t*>(scales.data.data()) + scales.data.size());
    const std::vector<float> x = dequantize(qz);
    std::vector<int64_t> shape = codes.shape;
    shape.back() = qz.cols;
    write_npy(d->out, NpyType::f32, shape, x.data());
  });
}

}  // namespace dmattn::cli
