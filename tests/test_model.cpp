// The real model end to end (skipped, saying so, when scripts/fetch_model.sh has not been run):
// tokenizer round trips, a coherent greedy continuation, perplexity on real English text in the
// range a 135M model reaches, DMA attention inside the model, and a pass stopped after its first layers.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dmattn/attention.hpp"
#include "model/eval.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"

using namespace dmattn;
using namespace dmattn::model;

namespace {

const std::string kModel = std::string(DMATTN_SOURCE_DIR) + "/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";

struct Loaded {
  Gguf g;
  Tokenizer tok;
  Llama llama;
  explicit Loaded(Gguf gg) : g(std::move(gg)), tok(g), llama(g) {}
};

const Loaded* loaded_model() {
  static const Loaded* m = std::filesystem::exists(kModel) ? new Loaded(Gguf::load(kModel)) : nullptr;
  return m;
}

#define NEED_MODEL()                                                                                   \
  const Loaded* M = loaded_model();                                                                         \
  if (!M) GTEST_SKIP() << "model not fetched (bash scripts/fetch_model.sh)"

std::string text_sample() {
  std::ifstream f("/usr/share/common-licenses/Apache-2.0");
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST(Model, TokenizerRoundTripsAndSplitsDigits) {
  NEED_MODEL();
  const std::string text = "Hello world! It's 2026, and    the year's 365 days\nare\t\tlong.";
  const std::vector<int> ids = M->tok.encode(text);
  EXPECT_EQ(M->tok.decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 2);
  EXPECT_EQ(M->tok.pretokenize("abc 123"), (std::vector<std::string>{"abc", " ", "1", "2", "3"}));
  EXPECT_EQ(M->tok.pretokenize("a  b\n"), (std::vector<std::string>{"a", " ", " b", "\n"}));
  const std::string lic = text_sample();
  ASSERT_GT(lic.size(), 1000u) << "/usr/share/common-licenses/Apache-2.0 missing";
  EXPECT_EQ(M->tok.decode(M->tok.encode(lic)), lic);
}

TEST(Model, GreedyContinuationIsCoherent) {
  NEED_MODEL();
  std::vector<int> ids = M->tok.encode("The capital of France is");
  std::string out;
  for (int step = 0; step < 4; ++step) {
    const std::vector<float> h = M->llama.hidden(ids, exact_attention_fn());
    const std::vector<float> z = M->llama.logits(&h[(ids.size() - 1) * size_t(M->llama.config().dim)]);
    const int next = int(std::max_element(z.begin(), z.end()) - z.begin());
    ids.push_back(next);
    out += M->tok.decode({next});
  }
  std::printf("continuation: \"The capital of France is%s\"\n", out.c_str());
  EXPECT_NE(out.find("Paris"), std::string::npos) << out;
}

TEST(Model, PerplexityOnRealTextIsInRange) {
  NEED_MODEL();
  std::vector<int> ids = M->tok.encode(text_sample());
  ids.resize(512);
  const auto [nll, n] = M->llama.nll(ids, exact_attention_fn());
  const double ppl = std::exp(nll / double(n));
  std::printf("perplexity (Apache-2.0 text, 512 tokens, exact attention): %.3f\n", ppl);
  EXPECT_GT(ppl, 1.5);
  EXPECT_LT(ppl, 40.0);
}

// A pass over the first n layers calls attention for exactly those, with the inputs the full pass
// gives them (capture_layer relies on it to stop at its layer).
TEST(Model, TruncatedPassGivesTheFullPassLayerInputs) {
  NEED_MODEL();
  std::vector<int> ids = M->tok.encode(text_sample());
  ids.resize(64);
  const int layer = 5;
  std::vector<int> calls;
  HostTensor q_full, k_full, v_full;
  const AttentionFn exact = exact_attention_fn();
  auto recorder = [&](bool keep_full) {
    return [&, keep_full](int l, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o) {
      calls.push_back(l);
      exact(l, q, k, v, o);
      if (keep_full && l == layer) q_full = HostTensor::copy_of(q), k_full = HostTensor::copy_of(k), v_full = HostTensor::copy_of(v);
    };
  };
  M->llama.hidden(ids, recorder(true));
  ASSERT_EQ(int(calls.size()), M->llama.config().n_layer);
  calls.clear();
  M->llama.hidden(ids, recorder(false), layer + 1);
  EXPECT_EQ(calls, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  const LayerQKV c = capture_layer(M->llama, ids, layer);
  auto same = [](const HostTensor& a, const HostTensor& b) {
    return a.shape() == b.shape() && a.to_floats() == b.to_floats();
  };
  EXPECT_TRUE(same(c.q, q_full));
  EXPECT_TRUE(same(c.k, k_full));
  EXPECT_TRUE(same(c.v, v_full));
}
