#include "model/eval.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>

#include "dmattn/error.hpp"

namespace dmattn::model {

std::vector<std::string> default_text_files() {
  const std::string d = "/usr/share/common-licenses/";
  return {d + "GPL-3", d + "GPL-2", d + "LGPL-2.1", d + "Apache-2.0", d + "MPL-2.0", d + "GFDL-1.3", d + "Artistic", d + "CC0-1.0"};
}

std::string read_text_files(const std::vector<std::string>& files) {
  std::string all;
  for (const std::string& f : files) {
    std::ifstream in(f);
    if (!in) throw Error(f + ": cannot open text file");
    std::stringstream s;
    s << in.rdbuf();
    all += s.str() + "\n";
  }
  return all;
}

namespace {
// The paper's recipe: MXFP8 E4M3 on `diag` tiles at the diagonal and `sinks` leading tiles, MXFP4
// elsewhere, OCP scales, bf16 P.V, no transforms.
Policy dma(int diag, int sinks) {
  Policy p = Policy::tiles(Format::mxfp8_e4m3, Format::mxfp4, diag, sinks);
  p.scale_rule = ScaleRule::ocp;
  p.pv = PV::bf16;
  return p;
}
Policy uniform(Format f) {
  Policy p = dma(0, 0);
  p.high = p.low = f;
  return p;
}
template <class F>
Policy with(Policy p, F&& change) {
  change(p);
  return p;
}
}  // namespace

std::vector<EvalConfig> named_configs() {
  std::vector<EvalConfig> c{
      {"exact", {}, true, "fp64 attention: the baseline every other row is measured against"},
      {"default", Policy{}, false, "the library's default policy (" + Policy{}.describe() + ")"},
      {"bf16", uniform(Format::bf16), false, "every tile in bf16"},
      {"mxfp8", uniform(Format::mxfp8_e4m3), false, "every tile in MXFP8 E4M3"},
      {"mxfp8-e5m2", uniform(Format::mxfp8_e5m2), false, "every tile in MXFP8 E5M2"},
      {"mxfp4", uniform(Format::mxfp4), false, "every tile in MXFP4"},
      {"nvfp4", uniform(Format::nvfp4), false, "every tile in NVFP4"}};
  for (int sinks : {0, 1})
    for (int diag : {1, 2, 4, 8}) {
      const std::string name = "diag" + std::to_string(diag) + (sinks ? "-sink" + std::to_string(sinks) : "");
      c.push_back({name, dma(diag, sinks), false,
                   "MXFP8 on " + std::to_string(diag) + " diagonal tile(s)" + (sinks ? " and the sink tile" : "") +
                       ", MXFP4 elsewhere"});
    }
  c.push_back({"pv-mxfp8", with(dma(1, 0), [](Policy& p) { p.pv = PV::mxfp8; }), false, "diag1 with P and V in MXFP8"});
  c.push_back({"pv-mxfp4", with(dma(1, 0), [](Policy& p) { p.pv = PV::mxfp4; }), false, "diag1 with V in MXFP4"});
  c.push_back({"bf16-pv-mxfp4", with(uniform(Format::bf16), [](Policy& p) { p.pv = PV::mxfp4; }), false,
               "V in MXFP4 alone (Q and K in bf16)"});
  return c;
}

std::vector<std::string> default_eval_names() { return {"exact", "default", "mxfp8", "mxfp4"}; }

const std::vector<ConfigModifier>& config_modifiers() {
  static const std::vector<ConfigModifier> m{
      {"sk", "smooth_k: K's channel mean removed", [](Policy& p) { p.smooth_k = true; }},
      {"sq", "smooth_q: each head's query mean removed, mu.k added back exactly", [](Policy& p) { p.smooth_q = SmoothQ::all; }},
      {"sqh", "smooth_q=high: the same on the high tiles alone", [](Policy& p) { p.smooth_q = SmoothQ::high; }},
      {"rot", "rotate: randomized Hadamard along d on Q and K", [](Policy& p) { p.rotate = true; }},
      {"sink", "sink_keys=1: key 0 scored exactly", [](Policy& p) { p.sink_keys = 1; }},
      {"ceil", "the ceil scale rule", [](Policy& p) { p.scale_rule = ScaleRule::ceil; }},
      {"qr", "q_residual: the high tiles' queries in two FP8 terms", [](Policy& p) { p.q_residual = true; }},
      {"nv", "NVFP4 as the low format", [](Policy& p) { p.low = Format::nvfp4; }},
      {"plain", "no transforms (smooth_k, smooth_q, rotate, sink_keys, q_residual off)",
       [](Policy& p) {
         p.smooth_k = p.rotate = p.q_residual = false;
         p.smooth_q = SmoothQ::off;
         p.sink_keys = 0;
       }}};
  return m;
}

EvalConfig config_by_name(const std::string& name) {
  const size_t plus = name.find('+');
  const std::string base = name.substr(0, plus);
  const std::vector<EvalConfig> all = named_configs();
  const auto it = std::find_if(all.begin(), all.end(), [&](const EvalConfig& c) { return c.name == base; });
  if (it == all.end()) throw Error("no config named '" + base + "' (see dmattn eval --help for the names)");
  EvalConfig c = *it;
  for (size_t at = plus; at != std::string::npos;) {
    const size_t next = name.find('+', at + 1);
    const std::string mod = name.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    const auto& mods = config_modifiers();
    const auto m = std::find_if(mods.begin(), mods.end(), [&](const ConfigModifier& x) { return x.name == mod; });
    if (m == mods.end() || c.exact) throw Error("config '" + name + "': no modifier '+" + mod + "' for " + base);
    m->apply(c.policy);
    c.what += "; " + m->what;
    at = next;
  }
  c.policy.validate();
  c.name = name;
  return c;
}

namespace {
AttentionFn policy_fn(const EvalConfig& c, int threads) {
  return [c, threads](int, int64_t window, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out) {
    AttentionOptions o;
    o.causal = true;
    o.window_left = window;
    o.exact = c.exact;
    o.policy = c.policy;
    o.threads = threads;
    o.backend = Backend::cpu;
    attention(q, k, v, out, nullptr, o);
  };
}
}  // namespace

std::vector<EvalResult> evaluate(const Transformer& model, const std::vector<int>& tokens,
                                 const std::vector<EvalConfig>& configs, const EvalOptions& opts) {
  if (opts.ctx < 16) throw Error("eval: context too short");
  const int64_t text_per_window = opts.bos >= 0 ? opts.ctx - 1 : opts.ctx;
  auto window_tokens = [&](int64_t wi) {
    std::vector<int> w;
    if (opts.bos >= 0) w.push_back(opts.bos);
    w.insert(w.end(), tokens.begin() + wi * text_per_window, tokens.begin() + (wi + 1) * text_per_window);
    return w;
  };
  int64_t windows = int64_t(tokens.size()) / text_per_window;
  if (opts.max_windows > 0) windows = std::min(windows, opts.max_windows);
  if (windows == 0) throw Error("eval: the text has fewer tokens (" + std::to_string(tokens.size()) + ") than one window (" + std::to_string(opts.ctx) + ")");
  const int L = model.config().n_layer;
  std::vector<EvalResult> res(configs.size());
  for (size_t i = 0; i < configs.size(); ++i) {
    res[i].name = configs[i].name;
    res[i].layer_rel_l2.assign(size_t(L), 0.0);
  }
  // Per-layer errors on the first window: every policy on the same exact-pass Q/K/V.
  {
    std::vector<double> err2(configs.size() * size_t(L), 0.0), ref2(size_t(L), 0.0);
    const std::vector<int> w = window_tokens(0);
    const AttentionFn exact = policy_fn({"exact", {}, true, ""}, opts.threads);
    model.hidden(w, [&](int layer, int64_t window, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out) {
      exact(layer, window, q, k, v, out);
      HostTensor tmp(DType::f32, out.shape);
      const std::vector<float> r = HostTensor::copy_of(out).to_floats();
      for (double x : r) ref2[size_t(layer)] += x * x;
      for (size_t c = 0; c < configs.size(); ++c) {
        if (configs[c].exact) continue;
        policy_fn(configs[c], opts.threads)(layer, window, q, k, v, tmp.view());
        const std::vector<float> t = tmp.to_floats();
        double e = 0;
        for (size_t i = 0; i < t.size(); ++i) e += (double(t[i]) - r[i]) * (double(t[i]) - r[i]);
        err2[c * size_t(L) + size_t(layer)] += e;
      }
      if (opts.progress) opts.progress(size_t(-1), layer, L);
    });
    for (size_t c = 0; c < configs.size(); ++c)
      for (int l = 0; l < L; ++l) res[c].layer_rel_l2[size_t(l)] = std::sqrt(err2[c * size_t(L) + size_t(l)] / ref2[size_t(l)]);
  }
  for (size_t c = 0; c < configs.size(); ++c) {
    const auto t0 = std::chrono::steady_clock::now();
    double nll = 0;
    int64_t n = 0;
    for (int64_t wi = 0; wi < windows; ++wi) {
      if (opts.progress) opts.progress(c, wi, windows);
      const std::vector<int> w = window_tokens(wi);
      const auto [s, k] = model.nll(w, policy_fn(configs[c], opts.threads), opts.ctx / 2);
      nll += s;
      n += k;
    }
    res[c].ppl = std::exp(nll / double(n));
    res[c].scored = n;
    res[c].seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (opts.on_result) opts.on_result(res[c]);
  }
  return res;
}

LayerQKV capture_layer(const Transformer& model, const std::vector<int>& tokens, int layer) {
  if (layer < 0 || layer >= model.config().n_layer) throw Error("capture_layer: no layer " + std::to_string(layer));
  LayerQKV out;
  const AttentionFn exact = exact_attention_fn();
  // Layers after `layer` do not change its inputs: the forward pass stops there.
  model.hidden(
      tokens,
      [&](int l, int64_t window, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o) {
        exact(l, window, q, k, v, o);
        if (l != layer) return;
        out.q = HostTensor::copy_of(q);
        out.k = HostTensor::copy_of(k);
        out.v = HostTensor::copy_of(v);
      },
      layer + 1);
  return out;
}

}  // namespace dmattn::model
