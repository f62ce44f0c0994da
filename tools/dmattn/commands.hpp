// Subcommands of the `dmattn` tool. Each add_* registers its options and its callback; callbacks
// throw dmattn::Error on bad input, which main() prints as one line with a non-zero exit.
#pragma once
#include <CLI/CLI.hpp>

#include "dmattn/attention.hpp"

namespace dmattn::cli {

// Policy / backend options shared by the commands that run attention.
// The policy flags start from the library's default Policy, so --help shows it.
struct PolicyArgs {
  Policy policy{};  // the integer and boolean fields are bound directly, the named ones parsed by options()
  std::string high{format_name(policy.high)}, low{format_name(policy.low)}, pv{pv_name(policy.pv)},
      scale_rule{scale_rule_name(policy.scale_rule)}, smooth_q{smooth_q_name(policy.smooth_q)}, backend = "auto";
  int threads = 0;
  std::vector<const CLI::Option*> policy_options;  // the flags that set the policy, for policy_given()
  void add_to(CLI::App& app, bool with_backend = true);  // with --backend and --threads
  AttentionOptions options() const;  // throws dmattn::Error for unknown names
  bool policy_given() const;         // whether the command line set any policy flag
};

// --threads, 0 (all) up to this machine's hardware threads.
void add_threads(CLI::App& app, int& threads);
// --repeat N: run N times and report the median time.
void add_repeat(CLI::App& app, int& repeat);
// --window LEFT,RIGHT: a sliding window as flash-attn's window_size (-1: that side unbounded).
void add_window(CLI::App& app, std::pair<int64_t, int64_t>& window, const char* note);

// The .npy files of a command that runs attention: inputs, output and the optional LSE.
struct QkvFiles {
  std::string q, k, v, out, lse;
  // Registers --q --k --v --out (required) and --lse with the given help texts for the inputs.
  void add_to(CLI::App& cmd, const std::string& q_help, const std::string& k_help, const std::string& v_help);
};

// Throws dmattn::Error unless every non-empty path of (flag, path) can be written and no two name
// the same file: checked before any work, so that a bad path never costs a run or half its output.
void check_outputs(const std::vector<std::pair<std::string, std::string>>& outputs);

// The model scripts/fetch_model.sh installs: $DMATTN_MODEL, else .cache/models/... found from the
// working directory or the executable's folder upwards, or in the source tree the tool was built
// from (the relative path when none has it).
std::string default_model_path();

void add_run(CLI::App& app);
void add_decode(CLI::App& app);
void add_quantize(CLI::App& app);
void add_compare(CLI::App& app);
void add_demo(CLI::App& app);
void add_eval(CLI::App& app);
void add_capture(CLI::App& app);
void add_capabilities(CLI::App& app);

}  // namespace dmattn::cli
