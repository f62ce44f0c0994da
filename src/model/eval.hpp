// Quality of attention policies on a real model: perplexity over non-overlapping windows of real
// text (the second half of each window scored, as llama.cpp does), and per-layer attention-output
// error against fp64 on the model's own Q/K/V (measured on the first window).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "dmattn/attention.hpp"
#include "model/llama.hpp"

namespace dmattn::model {

struct EvalConfig {
  std::string name;
  Policy policy;
  bool exact = false;
};

// DMA with diag_tiles 1/2/4 x sink_tiles 0/1 (named "DMA diag=D sinks=S").
std::vector<EvalConfig> dma_grid();

// exact, all-bf16, all-MXFP8 E4M3 / E5M2, all-MXFP4, all-NVFP4, DMA diag 1/2/4 x sinks 0/1, the
// default DMA with the ceil rule, and with pv = mxfp8.
std::vector<EvalConfig> default_eval_configs();

struct EvalResult {
  std::string name;
  double ppl = 0;
  int64_t scored = 0;
  std::vector<double> layer_rel_l2;  // per layer, vs fp64 (0 for exact)
  double seconds = 0;
};

struct EvalOptions {
  int ctx = 2048;
  int64_t max_windows = 0;  // 0 = every full window of the text
  int threads = 0;
  // Called as work proceeds: (config index, window index, windows).
  std::function<void(size_t, int64_t, int64_t)> progress;
};

std::vector<EvalResult> evaluate(const Llama& model, const std::vector<int>& tokens,
                                 const std::vector<EvalConfig>& configs, const EvalOptions& opts);

// The model scripts/fetch_model.sh installs, relative to the repository root.
inline constexpr const char* kDefaultModelPath = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";
// Real English text on every Debian machine (package base-files): licence texts, which their
// licences allow to be copied verbatim.
std::vector<std::string> default_text_files();
std::string read_text_files(const std::vector<std::string>& files);  // concatenated, newline-separated

// Captures the post-RoPE Q/K/V of `layer` for `tokens` (shapes [1,H,T,hd]).
struct LayerQKV {
  HostTensor q, k, v;
};
LayerQKV capture_layer(const Llama& model, const std::vector<int>& tokens, int layer);

}  // namespace dmattn::model
