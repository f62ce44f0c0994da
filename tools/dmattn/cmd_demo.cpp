// `dmattn demo`: the main job on the embedded default. LLM-like attention inputs, the exact fp64
// reference, and DMA policies between all-MXFP8 and all-MXFP4, as a table of error and time.
#include <chrono>
#include <cstdio>
#include <vector>

#include <unistd.h>

#include "commands.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/synthetic.hpp"

namespace dmattn::cli {

void add_demo(CLI::App& app) {
  struct Args {
    int64_t n = 4096, heads = 4, kv_heads = 2, d = 128;
    uint64_t seed = 1;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("demo", "DMA vs all-MXFP8 / all-MXFP4 on generated LLM-like causal attention");
  cmd->add_option("--n", a->n, "sequence length")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--heads", a->heads, "query heads")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--kv-heads", a->kv_heads, "key/value heads")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--d", a->d, "head dim")->capture_default_str();
  cmd->add_option("--seed", a->seed, "generator seed")->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (0 = all)")->capture_default_str();
  cmd->callback([a] {
    const QKV x = llm_like_qkv({1, a->heads, a->kv_heads, a->n, a->n, a->d}, a->seed);
    struct Row {
      std::string name;
      Policy policy;
      bool exact = false;
    };
    std::vector<Row> rows{{"exact fp64", {}, true}, {"all-MXFP8 (e4m3)", Policy::all(Format::mxfp8_e4m3)},
                          {"all-MXFP4", Policy::all(Format::mxfp4)}};
    for (int sinks : {0, 1})
      for (int diag : {1, 2, 4}) {
        Policy p;
        p.diag_tiles = diag;
        p.sink_tiles = sinks;
        rows.push_back({"DMA diag=" + std::to_string(diag) + " sinks=" + std::to_string(sinks), p});
      }
    std::printf("dmattn demo: causal attention, B=1 Hq=%lld Hkv=%lld N=%lld d=%lld, LLM-like inputs (seed %llu), CPU\n",
                (long long)a->heads, (long long)a->kv_heads, (long long)a->n, (long long)a->d,
                (unsigned long long)a->seed);
    std::printf("high=MXFP8 E4M3, low=MXFP4 E2M1, scale rule ocp, pv bf16; error = rel. L2 of the output vs exact\n\n");
    std::printf("%-24s %14s %10s\n", "config", "rel_l2", "time_s");
    std::vector<float> ref;
    const bool tty = isatty(fileno(stderr));  // progress on a terminal only; logs stay clean
    for (size_t i = 0; i < rows.size(); ++i) {
      if (tty) std::fprintf(stderr, "[%zu/%zu] running %s ...\r", i + 1, rows.size(), rows[i].name.c_str());
      HostTensor out(DType::f32, x.q.shape());
      AttentionOptions o;
      o.causal = true;
      o.exact = rows[i].exact;
      o.policy = rows[i].policy;
      o.threads = a->threads;
      const auto t0 = std::chrono::steady_clock::now();
      attention(x.q.view(), x.k.view(), x.v.view(), out.view(), nullptr, o);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::vector<float> o_f = out.to_floats();
      if (rows[i].exact) ref = o_f;
      if (tty) std::fprintf(stderr, "%60s\r", "");
      std::printf("%-24s %14.4e %10.3f\n", rows[i].name.c_str(), compare(o_f, ref).rel_l2, secs);
      std::fflush(stdout);
    }
  });
}

}  // namespace dmattn::cli
