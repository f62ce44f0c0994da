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
  const model::Transformer llama(g);
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
    std::string model, dir = ".";
    int64_t n = 512;
    std::vector<int> layers{1};
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("capture", "write a real model's post-RoPE Q/K/V of some layers as float16 .npy");
  cmd->add_option("--model", a->model, "GGUF model (default: the fetched SmolLM2)");
  cmd->add_option("--n", a->n, "tokens of the GPL texts")->capture_default_str()->check(CLI::Range(1, 8192));
  cmd->add_option("--layer", a->layers, "layers to capture")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--out-dir", a->dir, "output folder (layer<L>_{q,k,v}.npy)")->capture_default_str();
  cmd->callback([a] {
    if (a->model.empty()) a->model = default_model_path();
    std::vector<std::pair<std::string, std::string>> outputs;
    for (int layer : a->layers)
      for (const char* name : {"q", "k", "v"})
        outputs.emplace_back("--out-dir", a->dir + "/layer" + std::to_string(layer) + "_" + name + ".npy");
    check_outputs(outputs);
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
    std::string model;
    int layer = -1;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "DMA vs all-MXFP8 / all-MXFP4 on a real model's attention (generated LLM-like inputs without the model)");
  cmd->add_option("--n", a->n, "sequence length")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  // The shape options describe generated inputs; a model fixes its own heads and head dim.
  CLI::Option* shape[] = {
      cmd->add_option("--heads", a->heads, "query heads (generated inputs)")->capture_default_str()->check(CLI::Range(1, 256)),
      cmd->add_option("--kv-heads", a->kv_heads, "key/value heads (generated inputs)")->capture_default_str()->check(CLI::Range(1, 256)),
      cmd->add_option("--d", a->d, "head dim (generated inputs): 32 to 256, a multiple of 32")->capture_default_str()->check(CLI::Range(32, 256)),
      cmd->add_option("--seed", a->seed, "generator seed (generated inputs)")->capture_default_str()};
  add_threads(*cmd, a->threads);
  cmd->add_flag("--synthetic", a->synthetic, "use generated inputs even when the model is installed");
  CLI::Option* model_opt = cmd->add_option("--model", a->model, "GGUF model for real activations (default: the fetched SmolLM2)");
  CLI::Option* layer_opt = cmd->add_option("--layer", a->layer, "model layer (default: the middle one)")->check(CLI::NonNegativeNumber);
  cmd->callback([a, shape, model_opt, layer_opt] {
    const bool explicit_model = model_opt->count() > 0;
    if (!explicit_model) a->model = default_model_path();
    if (explicit_model && !std::filesystem::exists(a->model)) throw Error("--model " + a->model + ": no such file");
    if (a->synthetic && (explicit_model || layer_opt->count() > 0))
      throw Error("--synthetic generates its inputs: --model and --layer do not apply");
    const bool real = !a->synthetic && std::filesystem::exists(a->model);
    for (const CLI::Option* o : shape)
      if (real && o->count() > 0)
        throw Error(o->get_name() + " shapes generated inputs; the model has its own (add --synthetic to use it)");
    if (!real && layer_opt->count() > 0) throw Error("--layer needs the model (" + a->model + " is not there)");
    if (!head_dim_supported(a->d) || a->heads % a->kv_heads != 0)
      throw Error("--heads must be a multiple of --kv-heads, and --d a multiple of 32 from 32 to 256");
    std::string what;
    QKV x;
    if (real) {
      std::fprintf(stderr, "demo: running %s over the text to capture a layer's Q/K/V ...\n", a->model.c_str());
      x = real_qkv(a->model, a->n, a->layer, what);
    } else {
      x = llm_like_qkv({1, a->heads, a->kv_heads, a->n, a->n, a->d}, a->seed);
      what = "generated LLM-like inputs (seed " + std::to_string(a->seed) + ")" +
             (a->synthetic ? "" : "; no model at " + a->model + " (scripts/fetch_model.sh fetches it)");
    }
    const Shape& qs = x.q.shape();
    std::vector<model::EvalConfig> rows;
    for (model::EvalConfig& c : model::named_configs())
      if (c.exact || c.name == "default" || c.name == "mxfp8" || c.name == "mxfp4" || c.name.rfind("diag", 0) == 0)
        rows.push_back(std::move(c));
    std::printf("dmattn demo: causal attention, B=1 Hq=%lld Hkv=%lld N=%lld d=%lld, CPU\ninputs: %s\n",
                (long long)qs[1], (long long)x.k.shape()[1], (long long)qs[2], (long long)qs[3], what.c_str());
    std::printf("error = rel. L2 of the output vs exact fp64 attention; diagN-sinkS: MXFP8 on N diagonal and S sink\n"
                "tiles, MXFP4 elsewhere; default: %s\n\n", Policy{}.describe().c_str());
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
