#include <algorithm>
#include <cstdio>
#include <thread>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "dmattn/format.hpp"

namespace dmattn::cli {

void PolicyArgs::add_to(CLI::App& app, bool with_backend) {
  const std::string fmts = "(" + format_names() + ")";
  app.add_option("--high", high, "format of high-precision tiles " + fmts)->capture_default_str();
  app.add_option("--low", low, "format of low-precision tiles " + fmts)->capture_default_str();
  app.add_option("--diag-tiles", policy.diag_tiles, "key tiles at and before the diagonal computed high")->capture_default_str();
  app.add_option("--sink-tiles", policy.sink_tiles, "leading key tiles computed high (attention sinks)")->capture_default_str();
  app.add_option("--pv", pv, "P.V precision (bf16|mxfp8|mxfp4|fp8; mxfp4: V in MXFP4; fp8: E4M3 P at scale 2^-8 and V with a scale per channel, prefill only)")->capture_default_str();
  app.add_option("--scale-rule", scale_rule, "MX shared-exponent rule (ocp|ceil)")->capture_default_str();
  auto on_off = [&](const std::string& name, bool& field, const std::string& help) {
    app.add_flag("--" + name + ",!--no-" + name, field, help + (field ? " (on by default)" : " (off by default)"));
  };
  on_off("smooth-k", policy.smooth_k, "subtract K's per-channel mean before quantizing (softmax-invariant)");
  app.add_option("--smooth-q", smooth_q,
                 "subtract each head's query mean, add its scores back exactly: on every tile (all, what a bare "
                 "--smooth-q means) or the high tiles alone (high); off by default")
      ->expected(0, 1)
      ->default_str("all")
      ->type_name("[off|high|all]");
  app.add_flag("--no-smooth-q{off}", smooth_q, "the same as --smooth-q off");
  on_off("rotate", policy.rotate, "randomized Hadamard rotation of Q and K along d before quantizing");
  app.add_option("--sink-keys", policy.sink_keys, "leading keys scored exactly from unquantized q and k")->capture_default_str();
  on_off("q-residual", policy.q_residual, "the high tiles take each query row plus its residual in E4M3 (two FP8 terms)");
  if (with_backend) {
    app.add_option("--backend", backend, "where to compute (auto|cpu|cuda)")->capture_default_str();
    add_threads(app, threads);
  }
  for (const char* name : {"--high", "--low", "--diag-tiles", "--sink-tiles", "--pv", "--scale-rule", "--smooth-k",
                           "--smooth-q", "--no-smooth-q", "--rotate", "--sink-keys", "--q-residual"})
    policy_options.push_back(app.get_option(name));
}

bool PolicyArgs::policy_given() const {
  for (const CLI::Option* o : policy_options)
    if (o->count() > 0) return true;
  return false;
}

void add_repeat(CLI::App& app, int& repeat) {
  app.add_option("--repeat", repeat, "run N times and report the median time (benchmarking)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
}

void add_window(CLI::App& app, std::pair<int64_t, int64_t>& window, const char* note) {
  app.add_option("--window", window, std::string("sliding window LEFT,RIGHT: a query at position p sees keys p-LEFT..p+RIGHT (-1: unbounded)") + note)
      ->delimiter(',')
      ->check(CLI::Range(int64_t(-1), INT64_MAX));
}

void add_threads(CLI::App& app, int& threads) {
  const int most = std::max(1, int(std::thread::hardware_concurrency()));
  app.add_option("--threads", threads, "CPU threads (0 = all " + std::to_string(most) + ")")
      ->capture_default_str()
      ->check(CLI::Range(0, most));
}

void QkvFiles::add_to(CLI::App& cmd, const std::string& q_help, const std::string& k_help, const std::string& v_help) {
  cmd.add_option("--q", q, q_help)->required();
  cmd.add_option("--k", k, k_help)->required();
  cmd.add_option("--v", v, v_help)->required();
  cmd.add_option("--out", out, "output [B,Hq,Nq,d], float32")->required();
  cmd.add_option("--lse", lse, "row log-sum-exp [B,Hq,Nq], float32");
}

AttentionOptions PolicyArgs::options() const {
  AttentionOptions o;
  o.policy = policy;
  o.policy.high = parse_format(high);
  o.policy.low = parse_format(low);
  o.policy.pv = parse_pv(pv);
  o.policy.scale_rule = parse_scale_rule(scale_rule);
  o.policy.smooth_q = parse_smooth_q(smooth_q);
  o.policy.validate();
  o.backend = parse_backend(backend);
  o.threads = threads;
  return o;
}

}  // namespace dmattn::cli

int main(int argc, char** argv) {
  CLI::App app{"dmattn: diagonal-tiled mixed-precision attention over MX formats"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every subcommand");
  dmattn::cli::add_run(app);
  dmattn::cli::add_decode(app);
  dmattn::cli::add_quantize(app);
  dmattn::cli::add_compare(app);
  dmattn::cli::add_demo(app);
  dmattn::cli::add_eval(app);
  dmattn::cli::add_capture(app);
  dmattn::cli::add_capabilities(app);
  app.set_version_flag("--version", std::string("dmattn ") + DMATTN_VERSION);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Help and --version exit 0; every malformed command line exits 1, as bad input does.
    return app.exit(e) == 0 ? 0 : 1;
  } catch (const dmattn::Error& e) {
    std::fprintf(stderr, "dmattn: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmattn: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
