// The real model end to end (skipped, saying so, when scripts/fetch_model.sh has not been run):
// tokenizer round trips, a coherent greedy continuation, perplexity on real English text in the
// range a 135M model reaches, DMA attention inside the model, and a pass stopped after its first layers.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "dmattn/attention.hpp"
#include "model/eval.hpp"
#include "model/transformer.hpp"
#include "model/tokenizer.hpp"

using namespace dmattn;
using namespace dmattn::model;

namespace {

const std::string kModel = std::string(DMATTN_SOURCE_DIR) + "/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf";

struct Loaded {
  Gguf g;
  Tokenizer tok;
  Transformer llama;
  explicit Loaded(Gguf gg) : g(std::move(gg)), tok(g), llama(g) {}
};

// Each model file loaded once for the whole test binary; null when it has not been fetched.
const Loaded* load_once(const std::string& path) {
  static std::map<std::string, std::unique_ptr<Loaded>> models;
  auto it = models.find(path);
  if (it == models.end())
    it = models.emplace(path, std::filesystem::exists(path) ? std::make_unique<Loaded>(Gguf::load(path)) : nullptr).first;
  return it->second.get();
}
const Loaded* loaded_model() { return load_once(kModel); }

#define NEED_MODEL()                                                                                   \
  const Loaded* M = loaded_model();                                                                         \
  if (!M) GTEST_SKIP() << "model not fetched (bash scripts/fetch_model.sh)"

std::string text_sample() {
  std::ifstream f("/usr/share/common-licenses/Apache-2.0");
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// decode(encode(text)) is the text, in fewer tokens than half its bytes.
void expect_round_trip(const Tokenizer& tok, const std::string& text) {
  const std::vector<int> ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 2);
}

}  // namespace

TEST(Model, TokenizerRoundTripsAndSplitsDigits) {
  NEED_MODEL();
  expect_round_trip(M->tok, "Hello world! It's 2026, and    the year's 365 days\nare\t\tlong.");
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
    return [&, keep_full](int l, int64_t window, const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& o) {
      calls.push_back(l);
      exact(l, window, q, k, v, o);
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

// The second model family: Gemma-3-270M (scripts/fetch_model.sh gemma3): SentencePiece tokenizer,
// Q4_K/Q6_K/Q5_0 weights, the Gemma 3 forward pass with its sliding-window layers.
namespace {
const std::string kGemma = std::string(DMATTN_SOURCE_DIR) + "/.cache/models/gemma-3-270m-q4_k_m.gguf";
const Loaded* loaded_gemma() { return load_once(kGemma); }
#define NEED_GEMMA()                                         \
  const Loaded* G = loaded_gemma();                          \
  if (!G) GTEST_SKIP() << "model not fetched (bash scripts/fetch_model.sh gemma3)"
}  // namespace

TEST(Gemma, ConfigHasLocalAndGlobalLayers) {
  NEED_GEMMA();
  const ModelConfig& c = G->llama.config();
  EXPECT_EQ(c.arch, Arch::gemma3);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.n_kv, 1);
  EXPECT_EQ(c.window(0), 511);   // local: 512 positions, the query's own included
  EXPECT_EQ(c.window(5), -1);    // every sixth layer is global
  EXPECT_EQ(c.window(17), -1);
}

TEST(Gemma, TokenizerRoundTripsWithSentencePiecePieces) {
  NEED_GEMMA();
  expect_round_trip(G->tok, "Hello world! It's 2026,\n\nand    the year's 365 days\tare long. Ünïcödé ✓");
  // Whole words are single pieces with their leading space; newline runs are user-defined pieces.
  EXPECT_EQ(G->tok.encode(" the"), (std::vector<int>{506}));
  EXPECT_EQ(G->tok.encode("\n\n"), (std::vector<int>{108}));
  EXPECT_TRUE(G->tok.add_bos());
  const std::string lic = text_sample();
  EXPECT_EQ(G->tok.decode(G->tok.encode(lic)), lic);
}

// A base model of 270M parameters: it counts on, and tells the stock story.
TEST(Gemma, GreedyContinuationIsCoherent) {
  NEED_GEMMA();
  auto continue_greedy = [&](const std::string& prompt, int steps) {
    std::vector<int> ids = G->tok.encode(prompt);
    ids.insert(ids.begin(), G->tok.bos());
    std::string out;
    for (int step = 0; step < steps; ++step) {
      const std::vector<float> h = G->llama.hidden(ids, exact_attention_fn());
      const std::vector<float> z = G->llama.logits(&h[(ids.size() - 1) * size_t(G->llama.config().dim)]);
      const int next = int(std::max_element(z.begin(), z.end()) - z.begin());
      ids.push_back(next);
      out += G->tok.decode({next});
    }
    std::printf("continuation: \"%s%s\"\n", prompt.c_str(), out.c_str());
    return out;
  };
  EXPECT_EQ(continue_greedy("1, 2, 3, 4, 5,", 6).rfind(" 6, 7,", 0), 0u);
  EXPECT_NE(continue_greedy("Once upon a time, there was a", 3).find("little"), std::string::npos);
}

// Perplexity in a 270M model's range over 1024 tokens (longer than the local layers' window), and
// the window matters: the same pass with every layer global scores differently.
TEST(Gemma, PerplexityOnRealTextIsInRangeAndTheWindowIsApplied) {
  NEED_GEMMA();
  std::vector<int> ids = G->tok.encode(text_sample());
  ids.resize(1023);
  ids.insert(ids.begin(), G->tok.bos());
  const auto [nll, n] = G->llama.nll(ids, exact_attention_fn(), 512);
  const double ppl = std::exp(nll / double(n));
  const AttentionFn exact = exact_attention_fn();
  const auto [nll_global, n2] = G->llama.nll(
      ids, [&](int l, int64_t, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o) {
        exact(l, -1, q, k, v, o);
      }, 512);
  std::printf("Gemma-3-270M perplexity (Apache-2.0 text, tokens 512..1023): %.3f; every layer global: %.3f\n", ppl,
              std::exp(nll_global / double(n2)));
  EXPECT_GT(ppl, 1.5);
  EXPECT_LT(ppl, 40.0);
  EXPECT_NE(nll, nll_global);
}
