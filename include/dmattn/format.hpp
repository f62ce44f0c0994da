// The formats a tile (or a tensor) can be computed in, and their names.
#pragma once
#include <string>
#include <string_view>

#include "dmattn/mx_codec.hpp"

namespace dmattn {

enum class Format : uint8_t { mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4, nvfp4, bf16 };

struct FormatInfo {
  std::string_view name;
  Elem elem;      // element encoding (unused for bf16)
  int block;      // elements sharing one scale along the contraction dimension
  bool has_codes; // false for bf16, which is a plain rounding, not a block format
  double bits;    // storage bits per element, scales included
};

FormatInfo format_info(Format f);
std::string_view format_name(Format f);
// Parses a format name ("mxfp8-e4m3", "mxfp8-e5m2", "mxfp6-e3m2", "mxfp6-e2m3", "mxfp4", "nvfp4",
// "bf16"; "mxfp8" means E4M3). Throws dmattn::Error naming the valid choices.
Format parse_format(std::string_view name);
// "a|b|c", for messages and --help; quantized_only leaves out bf16 (no codes).
std::string format_names(bool quantized_only = false);

std::string_view scale_rule_name(ScaleRule r);
ScaleRule parse_scale_rule(std::string_view name);

}  // namespace dmattn
