#include "core/capabilities.hpp"

#include <algorithm>
#include <sstream>

#include "cuda/common/head_dims.hpp"
#include "dmattn/error.hpp"

namespace dmattn {
namespace {

const std::vector<Format> kMx32 = {Format::mxfp8_e4m3, Format::mxfp8_e5m2, Format::mxfp6_e3m2, Format::mxfp6_e2m3,
                                   Format::mxfp4};
constexpr std::string_view kAllMasks = "none, causal, q/k offsets, sliding window", kDecodeMasks = "causal, sliding window";
const std::vector<std::string_view> kAllTransforms = {"rotate", "smooth_k", "smooth_q", "sink_keys", "q_residual"},
                                   kGpuDecodeTransforms = {"rotate", "smooth_k", "smooth_q", "sink_keys"};
// The head dims the CUDA kernels are built for.
const std::vector<int64_t> kPrefillHeadDims = cuda::dim_vector(cuda::PrefillHeadDims{}),
                           kDecodeHeadDims = cuda::dim_vector(cuda::DecodeHeadDims{});

std::vector<Format> with_nvfp4(std::vector<Format> f) {
  f.push_back(Format::nvfp4);
  return f;
}

template <class T>
bool has(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string join(const std::vector<std::string_view>& v, std::string_view sep = ", ") {
  std::string s;
  for (std::string_view x : v) s += (s.empty() ? "" : std::string(sep)) + std::string(x);
  return s;
}

std::string head_dims_text(const Capabilities& c) {
  if (c.head_dims.empty()) return "multiples of 32 up to 256";
  std::string s, wide;
  for (int64_t x : c.head_dims) {
    s += (s.empty() ? "" : ", ") + std::to_string(x);
    if (c.mx_bf16_above && x > c.mx_bf16_above) wide += (wide.empty() ? "" : ", ") + std::to_string(x);
  }
  return wide.empty() ? s : s + " (" + wide + ": MX tiles, P·V bf16)";
}

// full: every format by name (the errors); else MX 32-block formats as "MX" (the table).
std::string formats_text(const Capabilities& c, bool full) {
  const bool mx = std::all_of(kMx32.begin(), kMx32.end(), [&](Format f) { return has(c.formats, f); });
  std::vector<std::string_view> v;
  for (Format f : c.formats)
    if (full || !mx || !has(kMx32, f)) v.push_back(format_info(f).name);
  const std::string rest = join(v);
  return full || !mx ? rest : "MX" + (rest.empty() ? "" : ", " + rest);
}

std::string pv_text(const Capabilities& c) {
  std::vector<std::string_view> v;
  for (PV p : c.pv) v.push_back(pv_name(p));
  return join(v);
}

std::string transforms_text(const Capabilities& c) {
  std::string s = c.transforms.empty() ? "none" : join(c.transforms);
  if (!c.transforms_mx_bf16.empty()) s += "; " + join(c.transforms_mx_bf16) + " with MX tiles and pv bf16";
  if (!c.note.empty()) s += " (" + std::string(c.note) + ")";
  return s;
}

// The transforms the policy turns on (Policy::transforms, space-separated), as names.
std::vector<std::string> transforms_of(const Policy& p) {
  std::vector<std::string> v;
  std::istringstream names(p.transforms());
  for (std::string t; names >> t;) v.push_back(t);
  return v;
}

}  // namespace

const Capabilities& cpu_capabilities() {
  static const Capabilities c{"the CPU backend", {}, {Format::bf16, Format::mxfp8_e4m3, Format::mxfp8_e5m2,
                              Format::mxfp6_e3m2, Format::mxfp6_e2m3, Format::mxfp4, Format::nvfp4},
                              {PV::bf16, PV::mxfp8, PV::mxfp4, PV::fp8}, kAllTransforms, {}, kAllMasks, "", "", ""};
  return c;
}

const Capabilities& kv_cache_capabilities() {
  static const Capabilities c{
      "the KV cache", {}, kMx32, {PV::bf16, PV::mxfp8, PV::mxfp4}, kAllTransforms, {}, kDecodeMasks,
      "smooth_q: prefill only, decode's queries are not smoothed",
      "its pages hold MX 32-blocks; pv=fp8's per-channel V scales depend on every token, which a cache cannot know",
      "attention() computes the rest over whole sequences"};
  return c;
}

const Capabilities& cuda_prefill_capabilities() {
  static const Capabilities c = [] {
    Capabilities c{"the CUDA prefill", kPrefillHeadDims, with_nvfp4(kMx32), {PV::bf16, PV::fp8}, {"rotate", "smooth_k"},
                   {"smooth_q", "sink_keys"}, kAllMasks, "",
                   "bf16 tiles and per-32-key-block P.V scales do not map onto Hopper's FP8 wgmma at speed; "
                   "at head dim 256 NVFP4's bf16 operands and pv=fp8's E4M3 V leave no room for three stages",
                   "the CPU backend computes every combination (CPU tensors), q_residual among them"};
    c.mx_bf16_above = cuda::kPrefillAllFormsMaxHeadDim;
    return c;
  }();
  return c;
}

const Capabilities& cuda_decode_capabilities() {
  static const Capabilities c{"the CUDA decode", kDecodeHeadDims, kMx32, {PV::bf16, PV::mxfp8, PV::mxfp4}, kGpuDecodeTransforms,
                              {}, kDecodeMasks, kv_cache_capabilities().note, "",
                              "the decode of CPU tensors takes every head dim and transform the KV cache does"};
  return c;
}

const Capabilities& cuda_kv_cache_capabilities() {
  static const Capabilities c{"the CUDA KV cache", kDecodeHeadDims, kMx32, {PV::bf16, PV::mxfp8, PV::mxfp4},
                              kGpuDecodeTransforms, {}, kDecodeMasks, kv_cache_capabilities().note, "",
                              "the KV cache (host memory) takes every head dim and q_residual"};
  return c;
}

void require(const Capabilities& c, const Policy& p, int64_t d) {
  // Every call of every entry point passes here: the messages are built only for a refusal.
  auto refuse = [&c](const std::string& what) {
    throw Error(std::string(c.name) + what + (c.why.empty() ? "" : " (" + std::string(c.why) + ")") +
                (c.elsewhere.empty() ? "" : "; " + std::string(c.elsewhere)));
  };
  if (!c.head_dims.empty() && !has(c.head_dims, d))
    refuse(" takes head dims " + head_dims_text(c) + " (got " + std::to_string(d) + ")");
  for (Format f : {p.high, p.low})
    if (!has(c.formats, f)) refuse(" takes tile formats " + formats_text(c, true) + ", not " + std::string(format_info(f).name));
  if (!has(c.pv, p.pv)) refuse(" takes pv " + pv_text(c) + ", not pv=" + std::string(pv_name(p.pv)));
  const bool mx_bf16 = p.pv == PV::bf16 && format_info(p.high).block == 32 && format_info(p.low).block == 32;
  if (c.mx_bf16_above && d > c.mx_bf16_above && !mx_bf16)
    refuse(" at head dim " + std::to_string(d) + " takes MX tiles with pv=bf16, not " + p.describe());
  for (const std::string& t : transforms_of(p)) {
    if (has(c.transforms, std::string_view(t))) continue;
    if (has(c.transforms_mx_bf16, std::string_view(t)) && mx_bf16) continue;
    refuse(" takes the transforms " + transforms_text(c) + "; not " + t + " with this policy (" + p.describe() + ")");
  }
}

std::string capabilities_markdown() {
  const Capabilities* cols[] = {&cpu_capabilities(), &kv_cache_capabilities(), &cuda_prefill_capabilities(),
                                &cuda_decode_capabilities(), &cuda_kv_cache_capabilities()};
  std::string s = "| |";
  for (const Capabilities* c : cols) s += " " + std::string(c->name) + " |";
  s += "\n|---|---|---|---|---|---|\n";
  auto row = [&](const char* what, auto text) {
    s += std::string("| ") + what + " |";
    for (const Capabilities* c : cols) s += " " + text(*c) + " |";
    s += "\n";
  };
  row("head dim", head_dims_text);
  row("tile formats", [](const Capabilities& c) { return formats_text(c, false); });
  row("P·V", pv_text);
  row("transforms", transforms_text);
  row("masks", [](const Capabilities& c) { return std::string(c.masks); });
  return s + "\nMX: the 32-element block formats mxfp8-e4m3, mxfp8-e5m2, mxfp6-e3m2, mxfp6-e2m3 and mxfp4.\n";
}

}  // namespace dmattn
