// `dmattn demo`: the main job on the embedded default. LLM-like attention inputs, the exact fp64
// reference, and DMA policies between all-MXFP8 and all-MXFP4, as a table of error and time.
#include <chrono>
#include <cstdio>
#include <vector>

#include <unistd.h>

#include "commands.hpp"
#include <filesystem>

#include "dmattn/error.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/npy.hpp"
#include "dmattn/synthetic.hpp"
#include "model/eval.hpp"
#include "model/tokenizer.hpp"

namespace dmattn::cli {

namespace {
// One layer's real Q/K/V: the model run over the first `n` tokens of the GPL texts.
QKV real_qkv(const std::string& path, int64_t n, int layer, std::string& what) {
  const model::Gguf g = model::Gguf::load(path);
  const model::Tokenizer tok(g);
  const model::Llama llama(g);
  std::vector<int> ids = tok.encode(model::read_text_files({"/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2"}));
  if (int64_t(ids.size()) < n) throw Error("the text has only " + std::to_string(ids.size()) + " tokens");
  ids.resize(size_t(n));
  if (layer < 0) layer = llama.config().n_layer / 2;
  model::LayerQKV c = model::capture_layer(llama, ids, layer);
  what = "real activations of " + std::filesystem::path(path).filename().string() + ", layer " + std::to_string(layer) +
         " on the first " + std::to_string(n) + " tokens of the GPL texts";
  return {std::move(c.q), std::move(c.k), std::move(c.v)};
}
}  // namespace

void add_capture(CLI::App& app) {
  struct Args {
    std::string model = model::kDefaultModelPath, dir = ".";
    int64_t n = 512;
    std::vector<int> layers{1};
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("capture", "write a real model's post-RoPE Q/K/V of some layers as float16 .npy");
  cmd->add_option("--model", a->model, "GGUF model")->capture_default_str();
  cmd->add_option("--n", a->n, "tokens of the GPL texts")->capture_default_str()->check(CLI::Range(1, 8192));
  cmd->add_option("--layer", a->layers, "layers to capture")->capture_default_str();
  cmd->add_option("--out-dir", a->dir, "output folder (layer<L>_{q,k,v}.npy)")->capture_default_str();
  cmd->callback([a] {
    for (int layer : a->layers) {
      std::string what;
      const QKV x = real_qkv(a->model, a->n, layer, what);
      for (auto [name, t] : {std::pair{"q", &x.q}, {"k", &x.k}, {"v", &x.v}}) {
        const HostTensor h = HostTensor::copy_of(t->view(), DType::f16);
        const Shape& s = h.shape();
        const std::string path = a->dir + "/layer" + std::to_string(layer) + "_" + name + ".npy";
        write_npy(path, NpyType::f16, {s[0], s[1], s[2], s[3]}, h.bytes());
        std::printf("%s %s\n", path.c_str(), shape_str(s).c_str());
      }
    }
  });
}

void add_demo(CLI::App& app) {
  struct Args {
    int64_t n = 2048, heads = 4, kv_heads = 2, d = 128;
    uint64_t seed = 1;
    int threads = 0;
    bool synthetic = false;
    std::string model = model::kDefaultModelPath;
    int layer = -1;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "DMA vs all-MXFP8 / all-MXFP4 on a real model's attention (generated LLM-like inputs without the model)");
  cmd->add_option("--n", a->n, "sequence length")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--heads", a->heads, "query heads")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--kv-heads", a->kv_heads, "key/value heads")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_option("--d", a->d, "head dim")->capture_default_str();
  cmd->add_option("--seed", a->seed, "generator seed")->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (0 = all)")->capture_default_str();
  cmd->add_flag("--synthetic", a->synthetic, "use generated inputs even when the model is installed");
  cmd->add_option("--model", a->model, "GGUF model for real activations")->capture_default_str();
  cmd->add_option("--layer", a->layer, "model layer (default: the middle one)");
  cmd->callback([a] {
    std::string what;
    const bool real = !a->synthetic && std::filesystem::exists(a->model);
    QKV x;
    if (real) {
      std::fprintf(stderr, "demo: running %s over the text to capture a layer's Q/K/V ...\n", a->model.c_str());
      x = real_qkv(a->model, a->n, a->layer, what);
    } else {
      x = llm_like_qkv({1, a->heads, a->kv_heads, a->n, a->n, a->d}, a->seed);
      what = "generated LLM-like inputs (seed " + std::to_string(a->seed) + ")" +
             (a->synthetic ? "" : "; run scripts/fetch_model.sh for real activations");
    }
    const Shape& qs = x.q.shape();
    std::vector<model::EvalConfig> rows{{"exact fp64", {}, true},
                                        {"all-MXFP8 (e4m3)", Policy::all(Format::mxfp8_e4m3)},
                                        {"all-MXFP4", Policy::all(Format::mxfp4)}};
    for (model::EvalConfig& d : model::dma_grid()) rows.push_back(std::move(d));
    std::printf("dmattn demo: causal attention, B=1 Hq=%lld Hkv=%lld N=%lld d=%lld, CPU\ninputs: %s\n",
                (long long)qs[1], (long long)x.k.shape()[1], (long long)qs[2], (long long)qs[3], what.c_str());
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
