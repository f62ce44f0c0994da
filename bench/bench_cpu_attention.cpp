// CPU DMA against a plain fp32 flash-attention loop of the same shape, in the same binary and run.
// The baseline is tiled the same way (K transposed per 128-key tile, online softmax, fp32 P.V) and
// threaded the same way, so the ratio measures what DMA's formats cost, not a tuning gap.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "dmattn/attention.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

namespace {

constexpr int64_t kN = 2048, kD = 64;
constexpr int T = 128;

// Plain fp32 flash attention for one head: q, k, v row-major [n, d].
void fp32_flash(const float* q, const float* k, const float* v, float* o, int64_t n, int d, bool causal, int threads) {
  const int64_t tiles = (n + T - 1) / T;
  std::vector<float> kt(size_t(tiles * T * d), 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int i = 0; i < d; ++i) kt[size_t(((j / T) * d + i) * T + j % T)] = k[j * d + i];
  const float scale = 1.0f / std::sqrt(float(d));
  cpu::parallel_for(tiles, threads, [&](int64_t qt) {
    float s[T];
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t r = qt * T; r < std::min(n, (qt + 1) * T); ++r) {
      const int64_t end = causal ? r + 1 : n;
      float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j * T < end; ++j) {
        const float* ktile = kt.data() + j * d * T;
        for (int n0 = 0; n0 < T; n0 += 32) {
          float t[32] = {};
          for (int i = 0; i < d; ++i) {
            const float qi = q[r * d + i];
            for (int c = 0; c < 32; ++c) t[c] += qi * ktile[i * T + n0 + c];
          }
          for (int c = 0; c < 32; ++c) s[n0 + c] = t[c] * scale;
        }
        const int nv = int(std::min<int64_t>(T, end - j * T));
        float mt = m;
        for (int c = 0; c < nv; ++c) mt = std::max(mt, s[c]);
        const float alpha = std::exp(m - mt);
        for (float& a : acc) a *= alpha;
        l *= alpha;
        for (int c = 0; c < nv; ++c) {
          const float p = std::exp(s[c] - mt);
          l += p;
          const float* vr = v + (j * T + c) * d;
          for (int i = 0; i < d; ++i) acc[size_t(i)] += p * vr[i];
        }
        m = mt;
      }
      for (int i = 0; i < d; ++i) o[r * d + i] = acc[size_t(i)] / l;
    }
  });
}

const QKV& inputs() {
  static const QKV x = random_qkv({1, 1, 1, kN, kN, kD}, 42);
  return x;
}

void BM_Fp32FlashLoop(benchmark::State& st) {
  const bool causal = st.range(0);
  const QKV& x = inputs();
  const std::vector<float> q = x.q.to_floats(), k = x.k.to_floats(), v = x.v.to_floats();
  std::vector<float> o(q.size());
  for (auto _ : st) {
    fp32_flash(q.data(), k.data(), v.data(), o.data(), kN, kD, causal, 0);
    benchmark::DoNotOptimize(o.data());
  }
}

void run_policy(benchmark::State& st, Policy pol) {
  const QKV& x = inputs();
  HostTensor out(DType::f32, x.q.shape());
  AttentionOptions o;
  o.causal = st.range(0);
  o.policy = pol;
  for (auto _ : st) {
    attention(x.q.view(), x.k.view(), x.v.view(), out.view(), nullptr, o);
    benchmark::DoNotOptimize(out.bytes());
  }
}

void BM_DmaDefault(benchmark::State& st) { run_policy(st, Policy{}); }
void BM_DmaPlain(benchmark::State& st) { run_policy(st, Policy::plain()); }
void BM_DmaAllMxfp8(benchmark::State& st) { run_policy(st, Policy::all(Format::mxfp8_e4m3)); }
void BM_DmaAllMxfp4(benchmark::State& st) { run_policy(st, Policy::all(Format::mxfp4)); }
void BM_DmaPvMxfp8(benchmark::State& st) {
  Policy p = Policy::plain();
  p.pv = PV::mxfp8;
  run_policy(st, p);
}

}  // namespace

BENCHMARK(BM_Fp32FlashLoop)->Arg(0)->Arg(1)->ArgName("causal")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DmaDefault)->Arg(0)->Arg(1)->ArgName("causal")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DmaPlain)->Arg(0)->Arg(1)->ArgName("causal")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DmaAllMxfp8)->Arg(0)->ArgName("causal")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DmaAllMxfp4)->Arg(0)->ArgName("causal")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DmaPvMxfp8)->Arg(0)->ArgName("causal")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_MAIN();
