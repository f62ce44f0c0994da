// Quality of attention policies on a real model: perplexity over non-overlapping windows of real
// text (the second half of each window scored, as llama.cpp does), and per-layer attention-output
// error against fp64 on the model's own Q/K/V (measured on the first window).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "dmattn/attention.hpp"
#include "model/transformer.hpp"

namespace dmattn::model {

struct EvalConfig {
  std::string name;  // short, for --only and tables
  Policy policy;
  bool exact = false;
  std::string what;  // one line for --help
};

// The configurations `dmattn eval` knows by name, in the order it runs them: "exact" (fp64), the
// library's "default" policy, uniform formats, the diagonal/sink grid, scale rule, P.V precision
// and transform variants. The grid's policies are spelled out in full, so they keep their meaning
// when the library's default changes.
std::vector<EvalConfig> named_configs();
// The subset `dmattn eval` runs when --only is not given.
std::vector<std::string> default_eval_names();
// The modifiers a config name can carry after its base, each "+name": the transforms and rules
// they turn on (e.g. "diag4-sink1+sq+rot" is diag4-sink1 with smooth_q and rotate).
struct ConfigModifier {
  std::string name, what;
  void (*apply)(Policy&);
};
const std::vector<ConfigModifier>& config_modifiers();
// A named config, base plus modifiers; throws dmattn::Error for an unknown name.
EvalConfig config_by_name(const std::string& name);

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
  int bos = -1;  // >= 0: every window starts with this token, then ctx - 1 tokens of text (models that expect BOS)
  // Called as work proceeds: (config index, window index, windows).
  std::function<void(size_t, int64_t, int64_t)> progress;
  // Called with each config's result as soon as it is complete, in order (the exact config first).
  std::function<void(const EvalResult&)> on_result;
};

std::vector<EvalResult> evaluate(const Transformer& model, const std::vector<int>& tokens,
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
LayerQKV capture_layer(const Transformer& model, const std::vector<int>& tokens, int layer);

}  // namespace dmattn::model
