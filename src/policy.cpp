#include "dmattn/policy.hpp"

#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"

namespace dmattn {

std::string Policy::describe() const {
  return "high=" + std::string(format_name(high)) + " low=" + std::string(format_name(low)) +
         " diag_tiles=" + std::to_string(diag_tiles) + " sink_tiles=" + std::to_string(sink_tiles) +
         " scale_rule=" + std::string(scale_rule_name(scale_rule)) + " pv=" + std::string(pv_name(pv)) +
         (smooth_k ? " smooth_k" : "");
}

std::string_view pv_name(PV p) {
  switch (p) {
    case PV::bf16: return "bf16";
    case PV::mxfp8: return "mxfp8";
    case PV::mxfp4: return "mxfp4";
    default: return "fp8";
  }
}

PV parse_pv(std::string_view name) {
  if (name == "bf16") return PV::bf16;
  if (name == "mxfp8") return PV::mxfp8;
  if (name == "mxfp4") return PV::mxfp4;
  if (name == "fp8") return PV::fp8;
  throw Error("unknown pv mode '" + std::string(name) + "' (choose bf16|mxfp8|mxfp4|fp8)");
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
