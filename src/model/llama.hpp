// A Llama-family forward pass on the CPU (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings as the file
// has them) over a GGUF model, with the attention call pluggable so that exact or any DMA policy
// (through dmattn::attention) can be measured on real activations.
#pragma once
#include <functional>
#include <vector>

#include "dmattn/tensor.hpp"
#include "model/gguf.hpp"

namespace dmattn::model {

struct LlamaConfig {
  int n_layer = 0, dim = 0, n_head = 0, n_kv = 0, head_dim = 0, ffn = 0, vocab = 0, ctx = 0;
  float rope_base = 10000.0f, eps = 1e-5f;
};

// Computes one layer's attention: q [1,Hq,T,hd], k and v [1,Hkv,T,hd] (post-RoPE), causal, into out
// [1,Hq,T,hd]. All views are strided fp32 host views.
using AttentionFn = std::function<void(int layer, const TensorView& q, const TensorView& k, const TensorView& v,
                                       const TensorView& out)>;

class Llama {
 public:
  explicit Llama(const Gguf& g, int threads = 0);
  const LlamaConfig& config() const { return c_; }

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
  };
  LlamaConfig c_;
  int threads_;
  std::vector<float> embed_, out_norm_, out_;  // out_ empty when tied to the embedding
  std::vector<Layer> layers_;
  const std::vector<float>& output_matrix() const { return out_.empty() ? embed_ : out_; }
};

// exact fp64 attention through dmattn::attention, for AttentionFn.
AttentionFn exact_attention_fn(int threads = 0);

}  // namespace dmattn::model
