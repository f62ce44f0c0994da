#include "dmattn/synthetic.hpp"

#include <cmath>
#include <vector>

namespace dmattn {

uint64_t Rng::next_u64() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return double(next_u64() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  const double u1 = 1.0 - uniform(), u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

QKV random_qkv(const QKVShape& s, uint64_t seed, DType dtype, float sigma) {
  Rng rng(seed);
  auto make = [&](int64_t h, int64_t n) {
    std::vector<float> v(size_t(s.B * h * n * s.d));
    for (float& x : v) x = float(sigma * rng.normal());
    return HostTensor::from_floats(v, {s.B, h, n, s.d}, dtype);
  };
  QKV r;
  r.q = make(s.Hq, s.Nq);
  r.k = make(s.Hkv, s.Nk);
  r.v = make(s.Hkv, s.Nk);
  return r;
}

namespace {
// Rotates pairs (i, i + d/2) of x by pos * 10000^(-2i/d) (the Llama RoPE layout).
void rope(float* x, int64_t d, int64_t pos) {
  for (int64_t i = 0; i < d / 2; ++i) {
    const double th = double(pos) * std::pow(10000.0, -2.0 * double(i) / double(d));
    const double c = std::cos(th), sn = std::sin(th), a = x[i], b = x[i + d / 2];
    x[i] = float(a * c - b * sn);
    x[i + d / 2] = float(a * sn + b * c);
  }
}
}  // namespace

QKV llm_like_qkv(const QKVShape& s, uint64_t seed, DType dtype) {
  Rng rng(seed);
  const int64_t n = s.Nk, d = s.d, group = s.Hq / s.Hkv;
  std::vector<float> q(size_t(s.B * s.Hq * n * d)), k(size_t(s.B * s.Hkv * n * d)), v(k.size());
  constexpr double rho = 0.97;  // token-to-token correlation of the content: locality
  constexpr double kSinkKey = 20.0, kSinkQuery = 1.0;  // attention-sink strength
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t hk = 0; hk < s.Hkv; ++hk) {
      // A sink direction every query leans towards and the first key carries strongly.
      std::vector<double> sink(static_cast<size_t>(d));
      double norm = 0;
      for (auto& x : sink) {
        x = rng.normal();
        norm += x * x;
      }
      for (auto& x : sink) x /= std::sqrt(norm);
      // Outlier channels: a few channels of K (and V) an order of magnitude larger, as in LLMs.
      std::vector<double> kgain(size_t(d), 1.0), vgain(size_t(d), 1.0);
      for (int o = 0; o < 3; ++o) kgain[size_t(rng.next_u64() % uint64_t(d))] = 8.0;
      for (int o = 0; o < 2; ++o) vgain[size_t(rng.next_u64() % uint64_t(d))] = 6.0;
      std::vector<double> content(static_cast<size_t>(d));
      for (auto& x : content) x = rng.normal();
      const double innov = std::sqrt(1 - rho * rho);
      std::vector<std::vector<float>> heads_q(size_t(group), std::vector<float>(size_t(n * d)));
      float* kh = k.data() + ((b * s.Hkv + hk) * n) * d;
      float* vh = v.data() + ((b * s.Hkv + hk) * n) * d;
      for (int64_t t = 0; t < n; ++t) {
        for (auto& x : content) x = rho * x + innov * rng.normal();
        float* kr = kh + t * d;
        for (int64_t i = 0; i < d; ++i) {
          kr[i] = float(kgain[size_t(i)] * (content[size_t(i)] + 0.5 * rng.normal()));
          vh[t * d + i] = float(vgain[size_t(i)] * (0.6 * content[size_t(i)] + 0.8 * rng.normal()));
        }
        rope(kr, d, t);
        // The sink is added after RoPE: position-independent, like the low-frequency channels
        // real models use for it.
        if (t == 0)
          for (int64_t i = 0; i < d; ++i) kr[i] += float(kSinkKey * sink[size_t(i)]);
        for (int64_t g = 0; g < group; ++g) {
          float* qr = heads_q[size_t(g)].data() + t * d;
          for (int64_t i = 0; i < d; ++i)
            qr[i] = float(0.6 * (content[size_t(i)] + 0.7 * rng.normal()));
          rope(qr, d, t);
          for (int64_t i = 0; i < d; ++i) qr[i] += float(kSinkQuery * sink[size_t(i)]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* qh = q.data() + ((b * s.Hq + hk * group + g) * n) * d;
        std::copy(heads_q[size_t(g)].begin(), heads_q[size_t(g)].end(), qh);
      }
    }
  }
  QKV r;
  r.q = HostTensor::from_floats(q, {s.B, s.Hq, n, d}, dtype);
  r.k = HostTensor::from_floats(k, {s.B, s.Hkv, n, d}, dtype);
  r.v = HostTensor::from_floats(v, {s.B, s.Hkv, n, d}, dtype);
  return r;
}

}  // namespace dmattn
