// The capabilities table (src/core/capabilities.hpp): each backend's checks accept what its table
// lists and reject the rest with a message that names the backend, what it takes and where the rest
// runs -- never a command-line flag, so Python and C++ callers read it as well.
#include <gtest/gtest.h>

#include <string>

#include "core/capabilities.hpp"
#include "dmattn/error.hpp"

using namespace dmattn;

namespace {

// The message require() throws, or "" where it accepts.
std::string refusal(const Capabilities& c, const Policy& p, int64_t d) {
  try {
    require(c, p, d);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

Policy sq_all() {
  Policy p;
  p.smooth_q = SmoothQ::all;
  p.sink_keys = 2;
  return p;
}

}  // namespace

TEST(Capabilities, AcceptWhatTheTableListsAndNameTheRest) {
  const Capabilities& gpu = cuda_prefill_capabilities();
  EXPECT_EQ(refusal(gpu, Policy{}, 128), "");
  EXPECT_EQ(refusal(gpu, Policy::tiles(Format::mxfp8_e4m3, Format::nvfp4, 1, 0), 64), "");

  Policy bf16 = Policy{};
  bf16.low = Format::bf16;
  const std::string m = refusal(gpu, bf16, 128);
  EXPECT_NE(m.find("the CUDA prefill"), std::string::npos) << m;
  EXPECT_NE(m.find("not bf16"), std::string::npos) << m;
  EXPECT_NE(m.find("CPU backend"), std::string::npos) << m;
  EXPECT_EQ(m.find("--"), std::string::npos) << "a library error names no CLI flag: " << m;

  EXPECT_NE(refusal(gpu, Policy{}, 96).find("head dims 64, 128, 256"), std::string::npos);
  EXPECT_EQ(refusal(cpu_capabilities(), Policy{}, 96), "");
  // Head dim 256: MX tiles with pv = bf16 (the transforms included), nothing else.
  EXPECT_EQ(refusal(gpu, sq_all(), 256), "");
  Policy nv256 = Policy::tiles(Format::mxfp8_e4m3, Format::nvfp4, 1, 0), pv256;
  pv256.pv = PV::fp8;
  EXPECT_NE(refusal(gpu, nv256, 256).find("at head dim 256 takes MX tiles with pv=bf16"), std::string::npos)
      << refusal(gpu, nv256, 256);
  EXPECT_NE(refusal(gpu, pv256, 256).find("at head dim 256"), std::string::npos);
  EXPECT_EQ(refusal(gpu, pv256, 128), "");
  EXPECT_EQ(refusal(cuda_decode_capabilities(), Policy{}, 256), "");

  Policy sq;  // smooth_q: MX tiles and pv = bf16 only on the GPU
  sq.smooth_q = SmoothQ::all;
  EXPECT_EQ(refusal(gpu, sq, 128), "");
  sq.pv = PV::fp8;
  EXPECT_NE(refusal(gpu, sq, 128).find("smooth_q"), std::string::npos);
  sq.pv = PV::bf16;
  sq.low = Format::nvfp4;
  EXPECT_NE(refusal(gpu, sq, 128).find("smooth_q"), std::string::npos);
  Policy rot;  // rotate and smooth_k with every tile format
  rot.rotate = rot.smooth_k = true;
  rot.low = Format::nvfp4;
  EXPECT_EQ(refusal(gpu, rot, 128), "");

  Policy pv8;
  pv8.pv = PV::fp8;
  EXPECT_NE(refusal(kv_cache_capabilities(), pv8, 64).find("pv=fp8"), std::string::npos);
  Policy rotk;
  rotk.rotate = rotk.smooth_k = true;
  rotk.sink_keys = 4;
  EXPECT_EQ(refusal(cuda_kv_cache_capabilities(), rotk, 64), "");
  EXPECT_NE(refusal(cuda_kv_cache_capabilities(), Policy{}, 96).find("96"), std::string::npos);
  EXPECT_NE(refusal(cuda_kv_cache_capabilities(), pv8, 128).find("pv=fp8"), std::string::npos);
  EXPECT_NE(refusal(cuda_decode_capabilities(), Policy::tiles(Format::mxfp8_e4m3, Format::nvfp4, 1, 0), 64).find("not nvfp4"),
            std::string::npos);
  for (const Capabilities* c : {&cpu_capabilities(), &kv_cache_capabilities(), &cuda_prefill_capabilities(),
                                &cuda_decode_capabilities(), &cuda_kv_cache_capabilities()})
    EXPECT_NE(capabilities_markdown().find(std::string(c->name)), std::string::npos);
}
