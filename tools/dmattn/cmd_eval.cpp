// `dmattn eval`: perplexity and per-layer attention error of attention policies on a real model and
// real text; a table on stdout, CSV to a file.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include <unistd.h>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "model/eval.hpp"
#include "model/tokenizer.hpp"

namespace dmattn::cli {

namespace {

std::string config_list() {
  std::string s;
  for (const model::EvalConfig& c : model::named_configs()) s += "\n  " + c.name + std::string(21 - std::min<size_t>(20, c.name.size()), ' ') + c.what;
  return s;
}

// The configs --only names, in the order given (exact first: it is the baseline); "all" names every
// base config, and a policy given by flags runs as "custom".
std::vector<model::EvalConfig> chosen(std::vector<std::string> only, const PolicyArgs& pa) {
  if (only.empty() && !pa.policy_given()) only = model::default_eval_names();
  std::vector<model::EvalConfig> out{model::config_by_name("exact")};
  for (const std::string& name : only) {
    if (name == "all") {
      for (const model::EvalConfig& c : model::named_configs())
        if (!c.exact) out.push_back(c);
    } else if (name == "custom") {
      if (!pa.policy_given()) throw Error("--only custom needs policy flags (--high, --low, --diag-tiles, ...)");
    } else if (name != "exact") {
      out.push_back(model::config_by_name(name));
    }
  }
  if (pa.policy_given()) out.push_back({"custom", pa.options().policy, false, pa.options().policy.describe()});
  return out;
}

std::string clock_str(double s) {
  char b[32];
  if (s >= 3600) std::snprintf(b, sizeof b, "%dh%02dm", int(s / 3600), int(s / 60) % 60);
  else std::snprintf(b, sizeof b, "%dm%02ds", int(s / 60), int(s) % 60);
  return b;
}

}  // namespace

void add_eval(CLI::App& app) {
  struct Args {
    std::string model, csv;
    std::vector<std::string> texts;
    int ctx = 2048, threads = 0;
    int64_t windows = 0;
    std::vector<std::string> only;
    PolicyArgs policy;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("eval", "perplexity and per-layer attention error of attention policies on a real model");
  cmd->footer("Configs (--only; default: " + [] {
    std::string s;
    for (const std::string& n : model::default_eval_names()) s += (s.empty() ? "" : " ") + n;
    return s;
  }() + "; 'all' runs every one):" + config_list() +
              "\nModifiers, appended to a name (e.g. diag4-sink1+sq+rot):" + [] {
                std::string s;
                for (const auto& m : model::config_modifiers())
                  s += "\n  +" + m.name + std::string(20 - std::min<size_t>(19, m.name.size()), ' ') + m.what;
                return s;
              }() + "\nPolicy flags (--high, --low, ...) add one more config, 'custom'.\n");
  cmd->add_option("--model", a->model, "GGUF model (default: the one scripts/fetch_model.sh fetches)");
  cmd->add_option("--text", a->texts, "text files (default: the licence texts in /usr/share/common-licenses)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--ctx", a->ctx, "window length in tokens")->capture_default_str()->check(CLI::Range(16, 1 << 20));
  cmd->add_option("--windows", a->windows, "windows to score (0 = every full window of the text)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40));
  cmd->add_option("--only", a->only, "configs to run, by name (listed below)")->delimiter(',');
  cmd->add_option("--csv", a->csv, "write results as CSV");
  a->policy.add_to(*cmd, /*with_backend=*/false);
  add_threads(*cmd, a->threads);
  cmd->callback([a] {
    // Everything a run can fail on is checked before the first window.
    check_outputs({{"--csv", a->csv}});
    const std::vector<model::EvalConfig> configs = chosen(a->only, a->policy);
    if (a->model.empty()) a->model = default_model_path();
    const model::Gguf g = model::Gguf::load(a->model);
    const model::Tokenizer tok(g);
    const model::Transformer llama(g, a->threads);
    if (a->ctx > llama.config().ctx)
      throw Error("--ctx " + std::to_string(a->ctx) + " exceeds the model's context (" + std::to_string(llama.config().ctx) + ")");
    std::vector<std::string> files = a->texts;
    if (files.empty()) files = model::default_text_files();
    const std::vector<int> tokens = tok.encode(model::read_text_files(files));
    model::EvalOptions o;
    o.ctx = a->ctx;
    o.max_windows = a->windows;
    o.threads = a->threads;
    o.bos = tok.add_bos() ? tok.bos() : -1;
    int64_t windows = int64_t(tokens.size()) / (o.bos >= 0 ? a->ctx - 1 : a->ctx);
    if (a->windows > 0) windows = std::min(windows, a->windows);
    const bool tty = isatty(fileno(stderr));
    using clock = std::chrono::steady_clock;
    clock::time_point phase_start = clock::now();
    o.progress = [&, phase = 0](size_t c, int64_t w, int64_t n) mutable {
      // Units of work: layers of the error pass, then (config, window) pairs; the estimate is the
      // current phase's time per unit so far times the units left in it.
      const bool layers = c == size_t(-1);
      if (!layers && phase == 0) {
        phase = 1;
        phase_start = clock::now();
      }
      const int64_t done = layers ? w : int64_t(c) * n + w, total = layers ? n : int64_t(configs.size()) * n;
      const double secs = std::chrono::duration<double>(clock::now() - phase_start).count();
      const std::string eta = done > 0 ? ", " + clock_str(secs / double(done) * double(total - done)) + " left" : "";
      if (layers)
        std::fprintf(stderr, "%sper-layer errors: layer %lld/%lld%s%s", tty ? "\r" : "", (long long)w + 1, (long long)n,
                     eta.c_str(), tty ? "     " : "\n");
      else
        std::fprintf(stderr, "%s[%zu/%zu] %-14s window %lld/%lld%s%s", tty ? "\r" : "", c + 1, configs.size(),
                     configs[c].name.c_str(), (long long)w + 1, (long long)n, eta.c_str(), tty ? "     " : "\n");
      std::fflush(stderr);
    };
    std::printf("dmattn eval: %s, %zu tokens of text, %lld windows of %d%s (second half scored), %zu configs\n",
                a->model.c_str(), tokens.size(), (long long)windows, a->ctx, o.bos >= 0 ? " (BOS first)" : "",
                configs.size());
    std::printf("\n%-28s %10s %9s %16s %8s\n", "config", "ppl", "vs exact", "mean layer relL2", "time_s");
    std::fflush(stdout);
    // Rows are printed (and written to the CSV) as each config completes: a long run interrupted
    // keeps what it finished.
    std::ofstream csv;
    if (!a->csv.empty()) {
      csv.open(a->csv);
      if (!csv) throw Error(a->csv + ": cannot write");
    }
    double base = 0;
    bool header = false;
    o.on_result = [&](const model::EvalResult& r) {
      if (base == 0) base = r.ppl;  // the exact config comes first
      double mean = 0;
      for (double e : r.layer_rel_l2) mean += e / double(r.layer_rel_l2.size());
      if (tty) std::fprintf(stderr, "\r%100s\r", "");
      std::printf("%-28s %10.4f %+8.3f%% %16.4e %8.1f\n", r.name.c_str(), r.ppl, 100 * (r.ppl / base - 1), mean, r.seconds);
      std::fflush(stdout);
      if (!csv.is_open()) return;
      if (!header) {
        csv << "config,ppl,ppl_vs_exact,scored_tokens,seconds";
        for (size_t l = 0; l < r.layer_rel_l2.size(); ++l) csv << ",layer" << l << "_rel_l2";
        csv << "\n";
        header = true;
      }
      csv << r.name << "," << r.ppl << "," << r.ppl / base - 1 << "," << r.scored << "," << r.seconds;
      for (double e : r.layer_rel_l2) csv << "," << e;
      csv << "\n" << std::flush;
    };
    model::evaluate(llama, tokens, configs, o);
    if (tty) std::fprintf(stderr, "\n");
    for (const auto& c : configs)
      if (c.name == "custom") std::printf("custom: %s\n", c.policy.describe().c_str());
  });
}

}  // namespace dmattn::cli
