// Generated attention inputs: i.i.d. normal ones for tests, and ones with the structure of real
// LLM attention (RoPE-rotated Q/K with locality, an attention sink, outlier channels) for the demo
// and benchmarks. Deterministic for a seed on every platform (own RNG, no std distributions).
#pragma once
#include <cstdint>

#include "dmattn/tensor.hpp"

namespace dmattn {

struct QKV {
  HostTensor q, k, v;
};

struct QKVShape {
  int64_t B = 1, Hq = 1, Hkv = 1, Nq = 128, Nk = 128, d = 64;
};

// Elements i.i.d. N(0, sigma^2).
QKV random_qkv(const QKVShape& s, uint64_t seed, DType dtype = DType::f32, float sigma = 1.0f);

// LLM-like prefill inputs (Nq == Nk == shape.Nk is used for both).
QKV llm_like_qkv(const QKVShape& s, uint64_t seed, DType dtype = DType::f32);

// A small reproducible RNG (splitmix64 + Box-Muller).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next_u64();
  double uniform();  // [0, 1)
  double normal();

 private:
  uint64_t state_;
};

}  // namespace dmattn
