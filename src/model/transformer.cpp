#include "model/transformer.hpp"

#include <algorithm>
#include <cmath>

#include "cpu/parallel.hpp"
#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"

namespace dmattn::model {

namespace {

// 16 independent partial sums: the compiler vectorises them without reassociating anything.
float dot(const float* a, const float* b, int n) {
  float acc[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += a[i + k] * b[i + k];
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (float x : acc) s += x;
  return s;
}

// Y[t][o] = sum_i X[t][i] W[o][i]  (W row-major [out][in], as GGUF stores it). A worker takes kRows
// outputs and walks the tokens kToks at a time, so its W rows and the current tokens' X rows stay in
// cache across every pair's dot (walking all T tokens per output streamed X, 4.7 MB at the demo's
// 2048 tokens, through the cache once per output row). Each (t, o) is the same dot in any order.
void matmul(const float* X, int T, int in, const std::vector<float>& W, int out, float* Y, int threads) {
  constexpr int kRows = 32, kToks = 32;
  cpu::parallel_for((out + kRows - 1) / kRows, threads, [&](int64_t blk) {
    const int o0 = int(blk) * kRows, o1 = std::min(out, o0 + kRows);
    for (int t0 = 0; t0 < T; t0 += kToks)
      for (int o = o0; o < o1; ++o)
        for (int t = t0; t < std::min(T, t0 + kToks); ++t) Y[size_t(t) * out + o] = dot(X + size_t(t) * in, W.data() + size_t(o) * in, in);
  });
}

void rmsnorm(const float* x, const std::vector<float>& w, int dim, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < dim; ++i) ss += double(x[i]) * x[i];
  const float r = float(1.0 / std::sqrt(ss / dim + eps));
  for (int i = 0; i < dim; ++i) y[i] = x[i] * r * w[size_t(i)];
}

// RoPE of `heads` rows of hd at position pos: pair (a, b) of each row turns by pos * base^(-2i/hd).
// Adjacent pairs (2i, 2i + 1), the layout GGUF Llama weights are converted to, or half-split pairs
// (i, i + hd/2), Gemma's.
void rope(float* x, int heads, int hd, int64_t pos, float base, bool half_split) {
  for (int i = 0; i < hd / 2; ++i) {
    const double th = double(pos) * std::pow(double(base), -2.0 * i / hd);
    const float c = float(std::cos(th)), s = float(std::sin(th));
    const int ia = half_split ? i : 2 * i, ib = half_split ? i + hd / 2 : 2 * i + 1;
    for (int h = 0; h < heads; ++h) {
      float* p = x + h * hd;
      const float a = p[ia], b = p[ib];
      p[ia] = a * c - b * s;
      p[ib] = a * s + b * c;
    }
  }
}

// GELU, tanh approximation (Gemma's gelu_pytorch_tanh).
float gelu_tanh(float x) {
  return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

std::vector<float> load(const Gguf& g, const std::string& name, int64_t numel) {
  std::vector<float> v = g.dequantize(name);
  if (int64_t(v.size()) != numel)
    throw Error("model: tensor " + name + " has " + std::to_string(v.size()) + " elements, expected " + std::to_string(numel));
  return v;
}

}  // namespace

Transformer::Transformer(const Gguf& g, int threads) : threads_(threads) {
  const std::string arch = g.get_string("general.architecture");
  if (arch != "llama" && arch != "gemma3")
    throw Error("model: architecture '" + arch + "' is not supported (llama, gemma3)");
  const std::string a = arch + ".";
  c_.arch = arch == "llama" ? Arch::llama : Arch::gemma3;
  c_.n_layer = int(g.get_int(a + "block_count"));
  c_.dim = int(g.get_int(a + "embedding_length"));
  c_.n_head = int(g.get_int(a + "attention.head_count"));
  c_.n_kv = int(g.has(a + "attention.head_count_kv") ? g.get_int(a + "attention.head_count_kv") : c_.n_head);
  c_.ffn = int(g.get_int(a + "feed_forward_length"));
  c_.ctx = int(g.get_int(a + "context_length"));
  c_.rope_base = float(g.has(a + "rope.freq_base") ? g.get_float(a + "rope.freq_base") : 10000.0);
  c_.eps = float(g.get_float(a + "attention.layer_norm_rms_epsilon"));
  if (c_.n_head <= 0 || c_.n_kv <= 0 || c_.n_head % c_.n_kv) throw Error("model: inconsistent head counts");
  c_.head_dim = g.has(a + "attention.key_length") ? int(g.get_int(a + "attention.key_length")) : c_.dim / c_.n_head;
  if (c_.head_dim <= 0 || (!g.has(a + "attention.key_length") && c_.dim % c_.n_head)) throw Error("model: inconsistent head dim");
  if (c_.arch == Arch::gemma3) {
    c_.sliding_window = int(g.get_int(a + "attention.sliding_window"));
    c_.swa_period = 6;           // Gemma 3: five local layers, then a global one
    c_.rope_base_local = 10000;  // the local layers' RoPE base
  }
  const int64_t qd = int64_t(c_.n_head) * c_.head_dim, kvd = int64_t(c_.n_kv) * c_.head_dim;
  c_.vocab = int(g.tensor("token_embd.weight").dims.at(1));
  embed_ = load(g, "token_embd.weight", int64_t(c_.vocab) * c_.dim);
  out_norm_ = load(g, "output_norm.weight", c_.dim);
  if (g.has_tensor("output.weight")) out_ = load(g, "output.weight", int64_t(c_.vocab) * c_.dim);
  layers_.resize(size_t(c_.n_layer));
  for (int l = 0; l < c_.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& L = layers_[size_t(l)];
    L.attn_norm = load(g, p + "attn_norm.weight", c_.dim);
    L.wq = load(g, p + "attn_q.weight", qd * c_.dim);
    L.wk = load(g, p + "attn_k.weight", kvd * c_.dim);
    L.wv = load(g, p + "attn_v.weight", kvd * c_.dim);
    L.wo = load(g, p + "attn_output.weight", int64_t(c_.dim) * qd);
    L.ffn_norm = load(g, p + "ffn_norm.weight", c_.dim);
    L.wg = load(g, p + "ffn_gate.weight", int64_t(c_.ffn) * c_.dim);
    L.wu = load(g, p + "ffn_up.weight", int64_t(c_.ffn) * c_.dim);
    L.wd = load(g, p + "ffn_down.weight", int64_t(c_.ffn) * c_.dim);
    if (c_.arch == Arch::gemma3) {
      L.q_norm = load(g, p + "attn_q_norm.weight", c_.head_dim);
      L.k_norm = load(g, p + "attn_k_norm.weight", c_.head_dim);
      L.post_attn_norm = load(g, p + "post_attention_norm.weight", c_.dim);
      L.post_ffn_norm = load(g, p + "post_ffw_norm.weight", c_.dim);
    }
  }
}

std::vector<float> Transformer::hidden(const std::vector<int>& tokens, const AttentionFn& attn, int n_layers) const {
  const int T = int(tokens.size()), D = c_.dim, hd = c_.head_dim, qd = c_.n_head * hd, kvd = c_.n_kv * hd;
  const bool gemma = c_.arch == Arch::gemma3;
  if (T == 0) throw Error("model: no tokens");
  std::vector<float> x(size_t(T) * D), h(x.size()), q(size_t(T) * qd), k(size_t(T) * kvd), v(k.size()), a(q.size()),
      o(x.size());
  std::vector<float> g(size_t(T) * c_.ffn), u(g.size());
  const float embed_scale = gemma ? std::sqrt(float(D)) : 1.0f;
  for (int t = 0; t < T; ++t) {
    if (tokens[size_t(t)] < 0 || tokens[size_t(t)] >= c_.vocab) throw Error("model: token id out of range");
    for (int i = 0; i < D; ++i) x[size_t(t) * D + i] = embed_[size_t(tokens[size_t(t)]) * D + i] * embed_scale;
  }
  // [T][H][hd] buffers seen as [1,H,T,hd] views.
  auto view = [&](float* p, int heads) {
    TensorView tv;
    tv.data = p;
    tv.dtype = DType::f32;
    tv.shape = {1, heads, T, hd};
    tv.stride = {int64_t(T) * heads * hd, hd, int64_t(heads) * hd, 1};
    return tv;
  };
  // x += norm(y) (gemma3's post-norms) or x += y.
  auto residual = [&](const std::vector<float>& post, std::vector<float>& y) {
    if (!post.empty())
      for (int t = 0; t < T; ++t) rmsnorm(&y[size_t(t) * D], post, D, c_.eps, &y[size_t(t) * D]);
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  };
  const int layers = n_layers < 0 ? c_.n_layer : std::min(n_layers, c_.n_layer);
  for (int l = 0; l < layers; ++l) {
    const Layer& L = layers_[size_t(l)];
    for (int t = 0; t < T; ++t) rmsnorm(&x[size_t(t) * D], L.attn_norm, D, c_.eps, &h[size_t(t) * D]);
    matmul(h.data(), T, D, L.wq, qd, q.data(), threads_);
    matmul(h.data(), T, D, L.wk, kvd, k.data(), threads_);
    matmul(h.data(), T, D, L.wv, kvd, v.data(), threads_);
    const int64_t window = c_.window(l);
    const float base = window >= 0 ? c_.rope_base_local : c_.rope_base;
    for (int t = 0; t < T; ++t) {
      float* qt = &q[size_t(t) * qd];
      float* kt = &k[size_t(t) * kvd];
      if (gemma) {
        for (int hh = 0; hh < c_.n_head; ++hh) rmsnorm(qt + hh * hd, L.q_norm, hd, c_.eps, qt + hh * hd);
        for (int hh = 0; hh < c_.n_kv; ++hh) rmsnorm(kt + hh * hd, L.k_norm, hd, c_.eps, kt + hh * hd);
      }
      rope(qt, c_.n_head, hd, t, base, gemma);
      rope(kt, c_.n_kv, hd, t, base, gemma);
    }
    attn(l, window, view(q.data(), c_.n_head), view(k.data(), c_.n_kv), view(v.data(), c_.n_kv), view(a.data(), c_.n_head));
    matmul(a.data(), T, qd, L.wo, D, o.data(), threads_);
    residual(L.post_attn_norm, o);
    for (int t = 0; t < T; ++t) rmsnorm(&x[size_t(t) * D], L.ffn_norm, D, c_.eps, &h[size_t(t) * D]);
    matmul(h.data(), T, D, L.wg, c_.ffn, g.data(), threads_);
    matmul(h.data(), T, D, L.wu, c_.ffn, u.data(), threads_);
    if (gemma)
      for (size_t i = 0; i < g.size(); ++i) g[i] = gelu_tanh(g[i]) * u[i];  // GeGLU
    else
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];  // SwiGLU
    matmul(g.data(), T, c_.ffn, L.wd, D, o.data(), threads_);
    residual(L.post_ffn_norm, o);
  }
  for (int t = 0; t < T; ++t) rmsnorm(&x[size_t(t) * D], out_norm_, D, c_.eps, &h[size_t(t) * D]);
  return h;
}

std::vector<float> Transformer::logits(const float* h) const {
  std::vector<float> z(size_t(c_.vocab));
  matmul(h, 1, c_.dim, output_matrix(), c_.vocab, z.data(), threads_);
  return z;
}

std::pair<double, int64_t> Transformer::nll(const std::vector<int>& tokens, const AttentionFn& attn, int64_t from) const {
  const std::vector<float> h = hidden(tokens, attn);
  const int64_t T = int64_t(tokens.size());
  std::vector<double> per(size_t(T), 0.0);
  // Logits kBlock tokens at a time through the blocked matmul: the output matrix (vocab x dim, 113 MB
  // for SmolLM2) then streams from memory once per block instead of once per token.
  constexpr int64_t kBlock = 64;
  std::vector<float> z(size_t(kBlock) * size_t(c_.vocab));
  for (int64_t t0 = from; t0 < T - 1; t0 += kBlock) {
    const int64_t nb = std::min(kBlock, T - 1 - t0);
    matmul(&h[size_t(t0) * c_.dim], int(nb), c_.dim, output_matrix(), c_.vocab, z.data(), threads_);
    cpu::parallel_for(nb, threads_, [&](int64_t i) {
      const float* zt = z.data() + size_t(i) * size_t(c_.vocab);
      double m = -1e300;
      for (int vv = 0; vv < c_.vocab; ++vv) m = std::max(m, double(zt[vv]));
      double s = 0;
      for (int vv = 0; vv < c_.vocab; ++vv) s += std::exp(double(zt[vv]) - m);
      per[size_t(t0 + i)] = m + std::log(s) - zt[tokens[size_t(t0 + i + 1)]];
    });
  }
  double sum = 0;
  for (int64_t t = from; t < T - 1; ++t) sum += per[size_t(t)];
  return {sum, T - 1 - from};
}

AttentionFn exact_attention_fn(int threads) {
  return [threads](int, int64_t window, const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out) {
    AttentionOptions o;
    o.causal = true;
    o.window_left = window;
    o.exact = true;
    o.threads = threads;
    attention(q, k, v, out, nullptr, o);
  };
}

}  // namespace dmattn::model
