#include "dmattn/policy.hpp"

#include <utility>

#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"

namespace dmattn {

std::string Policy::describe() const {
  return "high=" + std::string(format_name(high)) + " low=" + std::string(format_name(low)) +
         " diag_tiles=" + std::to_string(diag_tiles) + " sink_tiles=" + std::to_string(sink_tiles) +
         " scale_rule=" + std::string(scale_rule_name(scale_rule)) + " pv=" + std::string(pv_name(pv)) +
         (smooth_k ? " smooth_k" : "") + (smooth_q == SmoothQ::all ? " smooth_q" : smooth_q == SmoothQ::high ? " smooth_q=high" : "") + (rotate ? " rotate" : "") +
         (sink_keys ? " sink_keys=" + std::to_string(sink_keys) : "") + (q_residual ? " q_residual" : "");
}

void Policy::validate() const {
  if (diag_tiles < 0 || sink_tiles < 0 || sink_keys < 0) throw Error("diag_tiles, sink_tiles and sink_keys must be >= 0");
  if (smooth_q == SmoothQ::high && high == low)
    throw Error("smooth_q=high centres the high tiles' queries and not the low tiles': it needs two tile formats "
                "(high == low here; smooth_q=all centres every tile's)");
  if (q_residual && high == low)
    throw Error("q_residual gives the high tiles' queries a second term and not the low tiles': it needs two tile "
                "formats (high == low here)");
}

std::string Policy::transforms() const {
  std::string s;
  for (const auto& [on, name] : {std::pair{smooth_k, "smooth_k"}, {smooth_q != SmoothQ::off, "smooth_q"}, {rotate, "rotate"},
                                 {sink_keys > 0, "sink_keys"}, {q_residual, "q_residual"}})
    if (on) s += (s.empty() ? "" : " ") + std::string(name);
  return s;
}

namespace {
constexpr std::pair<PV, std::string_view> kPvNames[] = {
    {PV::bf16, "bf16"}, {PV::mxfp8, "mxfp8"}, {PV::mxfp4, "mxfp4"}, {PV::fp8, "fp8"}};
}  // namespace

std::string_view pv_name(PV p) {
  for (const auto& [pv, name] : kPvNames)
    if (pv == p) return name;
  return "?";
}

PV parse_pv(std::string_view name) {
  for (const auto& [pv, n] : kPvNames)
    if (n == name) return pv;
  throw Error("unknown pv mode '" + std::string(name) + "' (choose bf16|mxfp8|mxfp4|fp8)");
}

std::string_view smooth_q_name(SmoothQ s) {
  return s == SmoothQ::off ? "off" : s == SmoothQ::high ? "high" : "all";
}

SmoothQ parse_smooth_q(std::string_view name) {
  for (SmoothQ s : {SmoothQ::off, SmoothQ::high, SmoothQ::all})
    if (smooth_q_name(s) == name) return s;
  throw Error("unknown smooth_q '" + std::string(name) + "' (choose off|high|all)");
}

std::string_view backend_name(Backend b) {
  switch (b) {
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
    default: return "auto";
  }
}

Backend parse_backend(std::string_view name) {
  if (name == "auto") return Backend::automatic;
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  throw Error("unknown backend '" + std::string(name) + "' (choose auto|cpu|cuda)");
}

}  // namespace dmattn
