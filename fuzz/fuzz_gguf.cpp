// libFuzzer target for the GGUF reader: any byte string must parse or raise dmattn::Error — no
// crash, hang or unbounded allocation (run under AddressSanitizer; see fuzz/README.md).
#include <cstdint>
#include <vector>

#include "dmattn/error.hpp"
#include "model/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const dmattn::model::Gguf g = dmattn::model::Gguf::parse(std::vector<uint8_t>(data, data + size), "fuzz");
    for (const auto& t : g.tensors()) (void)g.dequantize(t.name);  // in bounds by construction
  } catch (const dmattn::Error&) {
  }
  return 0;
}
