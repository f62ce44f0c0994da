// Decoder-only transformer forward passes on the CPU over GGUF models, with the attention call
// pluggable so that exact or any DMA policy (through dmattn::attention) can be measured on real
// activations. Two families:
//  - llama (SmolLM2): RMSNorm, RoPE on adjacent pairs, GQA, SwiGLU, tied or separate output matrix.
//  - gemma3 (Gemma 3): embeddings scaled by sqrt(dim), RMSNorm before and after attention and the
//    FFN, per-head RMSNorm of q and k, RoPE on half-split pairs, GeGLU (tanh GELU), head dim
//    independent of the width, and local layers (five of every six) attending a sliding window
//    with their own RoPE base. The GGUF stores Gemma's norm weights with the +1 already added.
#pragma once
#include <functional>
#include <vector>

#include "dmattn/tensor.hpp"
#include "model/gguf.hpp"

namespace dmattn::model {

enum class Arch { llama, gemma3 };

struct ModelConfig {
  Arch arch = Arch::llama;
  int n_layer = 0, dim = 0, n_head = 0, n_kv = 0, head_dim = 0, ffn = 0, vocab = 0, ctx = 0;
  float rope_base = 10000.0f, eps = 1e-5f;
  // gemma3: layers with (layer + 1) % swa_period != 0 are local: a query sees the `sliding_window`
  // most recent positions (itself included), with RoPE base rope_base_local.
  int sliding_window = 0, swa_period = 0;
  float rope_base_local = 10000.0f;
  // The left extent of layer l's window (a query at p sees keys >= p - window), -1 if global.
  int64_t window(int layer) const {
    return sliding_window > 0 && swa_period > 0 && (layer + 1) % swa_period != 0 ? sliding_window - 1 : -1;
  }
};

// Computes one layer's attention: q [1,Hq,T,hd], k and v [1,Hkv,T,hd] (post-RoPE), causal, with the
// layer's sliding window (`window` keys before the query's position; -1: none), into out
// [1,Hq,T,hd]. All views are strided fp32 host views.
using AttentionFn = std::function<void(int layer, int64_t window, const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& out)>;

class Transformer {
 public:
  explicit Transformer(const Gguf& g, int threads = 0);
  const ModelConfig& config() const { return c_; }

  // Final hidden states (after the output norm), [T][dim]. n_layers >= 0 runs only the first n_layers
  // layers (attn is never called for the others): enough for a caller that wants one layer's inputs.
  std::vector<float> hidden(const std::vector<int>& tokens, const AttentionFn& attn, int n_layers = -1) const;
  // Logits of one hidden row, [vocab].
  std::vector<float> logits(const float* h) const;
  // Sum of -log p(tokens[t+1] | tokens[..t]) over t in [from, T-1), and the count of terms.
  std::pair<double, int64_t> nll(const std::vector<int>& tokens, const AttentionFn& attn, int64_t from = 0) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd;
    std::vector<float> q_norm, k_norm, post_attn_norm, post_ffn_norm;  // gemma3
  };
  ModelConfig c_;
  int threads_;
  std::vector<float> embed_, out_norm_, out_;  // out_ empty when tied to the embedding
  std::vector<Layer> layers_;
  const std::vector<float>& output_matrix() const { return out_.empty() ? embed_ : out_; }
};

// exact fp64 attention through dmattn::attention, for AttentionFn.
AttentionFn exact_attention_fn(int threads = 0);

}  // namespace dmattn::model
