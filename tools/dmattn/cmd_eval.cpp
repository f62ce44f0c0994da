// `dmattn eval`: perplexity and per-layer attention error of every policy on a real model and
// real text; a table on stdout, CSV to a file.
#include <cstdio>
#include <algorithm>
#include <fstream>

#include <unistd.h>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "model/eval.hpp"
#include "model/tokenizer.hpp"

namespace dmattn::cli {

void add_eval(CLI::App& app) {
  struct Args {
    std::string model = model::kDefaultModelPath, csv;
    std::vector<std::string> texts;
    int ctx = 2048, threads = 0;
    int64_t windows = 0;
    std::vector<std::string> only;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("eval", "perplexity and per-layer attention error of attention policies on a real model");
  cmd->add_option("--model", a->model, "GGUF model (scripts/fetch_model.sh fetches the default)")->capture_default_str();
  cmd->add_option("--text", a->texts, "text files (default: the licence texts in /usr/share/common-licenses)");
  cmd->add_option("--ctx", a->ctx, "window length in tokens")->capture_default_str()->check(CLI::Range(16, 1 << 20));
  cmd->add_option("--windows", a->windows, "windows to score (0 = all)")->capture_default_str();
  cmd->add_option("--only", a->only, "config names to run (default: all)");
  cmd->add_option("--csv", a->csv, "write results as CSV");
  cmd->add_option("--threads", a->threads, "CPU threads (0 = all)")->capture_default_str();
  cmd->callback([a] {
    const model::Gguf g = model::Gguf::load(a->model);
    const model::Tokenizer tok(g);
    const model::Llama llama(g, a->threads);
    if (a->ctx > llama.config().ctx)
      throw Error("--ctx " + std::to_string(a->ctx) + " exceeds the model's context (" + std::to_string(llama.config().ctx) + ")");
    std::vector<std::string> files = a->texts;
    if (files.empty()) files = model::default_text_files();
    const std::vector<int> tokens = tok.encode(model::read_text_files(files));
    std::vector<model::EvalConfig> configs;
    for (const auto& c : model::default_eval_configs())
      if (a->only.empty() || std::find(a->only.begin(), a->only.end(), c.name) != a->only.end() || c.exact)
        configs.push_back(c);
    model::EvalOptions o;
    o.ctx = a->ctx;
    o.max_windows = a->windows;
    o.threads = a->threads;
    const bool tty = isatty(fileno(stderr));
    o.progress = [&](size_t c, int64_t w, int64_t n) {
      if (c == size_t(-1))
        std::fprintf(stderr, "%sper-layer errors: layer %lld/%lld%s", tty ? "\r" : "", (long long)w + 1, (long long)n, tty ? "" : "\n");
      else
        std::fprintf(stderr, "%s[%zu/%zu] %-28s window %lld/%lld%s", tty ? "\r" : "", c + 1, configs.size(),
                     configs[c].name.c_str(), (long long)w + 1, (long long)n, tty ? "   " : "\n");
      std::fflush(stderr);
    };
    std::printf("dmattn eval: %s, %zu tokens of text, windows of %d (second half scored)\n", a->model.c_str(),
                tokens.size(), a->ctx);
    const auto res = model::evaluate(llama, tokens, configs, o);
    if (tty) std::fprintf(stderr, "\n");
    const double base = res.front().ppl;
    std::printf("\n%-30s %10s %9s %16s %8s\n", "config", "ppl", "vs exact", "mean layer relL2", "time_s");
    for (const auto& r : res) {
      double mean = 0;
      for (double e : r.layer_rel_l2) mean += e / double(r.layer_rel_l2.size());
      std::printf("%-30s %10.4f %+8.3f%% %16.4e %8.1f\n", r.name.c_str(), r.ppl, 100 * (r.ppl / base - 1), mean, r.seconds);
    }
    if (!a->csv.empty()) {
      std::ofstream f(a->csv);
      if (!f) throw Error(a->csv + ": cannot write");
      f << "config,ppl,ppl_vs_exact,scored_tokens,seconds";
      for (size_t l = 0; l < res.front().layer_rel_l2.size(); ++l) f << ",layer" << l << "_rel_l2";
      f << "\n";
      for (const auto& r : res) {
        f << '"' << r.name << '"' << "," << r.ppl << "," << r.ppl / base - 1 << "," << r.scored << "," << r.seconds;
        for (double e : r.layer_rel_l2) f << "," << e;
        f << "\n";
      }
    }
  });
}

}  // namespace dmattn::cli
