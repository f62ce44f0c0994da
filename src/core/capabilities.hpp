// What each backend computes, stated once: the table every backend's checks read (so a call it
// cannot compute fails with one message, naming what it takes and where the rest runs) and the one
// `dmattn capabilities` prints (the README's "Supported" table is that output, checked by a test).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dmattn/policy.hpp"

namespace dmattn {

struct Capabilities {
  std::string_view name;          // e.g. "the CUDA prefill"
  std::vector<int64_t> head_dims;  // empty: every multiple of 32 up to 256
  std::vector<Format> formats;    // tile formats (high and low); the decode's: its pages'
  std::vector<PV> pv;
  // The accuracy transforms (Policy::transforms names) taken with every format and P.V above, and
  // those taken only with MX tiles and pv = bf16.
  std::vector<std::string_view> transforms, transforms_mx_bf16;
  std::string_view masks;      // e.g. "none, causal, offsets, sliding window"
  std::string_view note;       // said under the transforms (the table)
  std::string_view why;        // why the limits are where they are (the errors)
  std::string_view elsewhere;  // where what it does not take runs (the errors)
  int64_t mx_bf16_above = 0;   // head dims above this take MX tiles and pv = bf16 alone (0: none)
};

const Capabilities& cpu_capabilities();           // attention on the CPU (every combination)
const Capabilities& kv_cache_capabilities();      // the KV cache and the CPU decode over it
const Capabilities& cuda_prefill_capabilities();  // attention on the GPU (sm_90a)
const Capabilities& cuda_decode_capabilities();   // decode on the GPU over a KV cache
const Capabilities& cuda_kv_cache_capabilities(); // the KV cache in GPU memory (PagedKVCache)

// Throws dmattn::Error where `c` does not take the policy or the head dim: the message names the
// backend, what it takes, and that the CPU backend computes the rest.
void require(const Capabilities& c, const Policy& p, int64_t head_dim);

// The tables as one markdown table (rows: head dims, tile formats, P.V, transforms, masks), and
// a line that names the MX formats.
std::string capabilities_markdown();

}  // namespace dmattn
