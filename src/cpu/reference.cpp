// The exact reference: softmax(Q K^T * scale) V with every product and sum in fp64.
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "problem.hpp"

namespace dmattn::cpu {

void exact_attention(const Problem& p) {
  const int64_t d = p.d, nk = p.Nk;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      std::vector<double> K(size_t(nk * d)), V(size_t(nk * d));
      std::vector<float> row(static_cast<size_t>(d));
      for (int64_t n = 0; n < nk; ++n) {
        load_row(p.k, b, hk, n, row.data());
        for (int64_t i = 0; i < d; ++i) K[size_t(n * d + i)] = row[size_t(i)];
        load_row(p.v, b, hk, n, row.data());
        for (int64_t i = 0; i < d; ++i) V[size_t(n * d + i)] = row[size_t(i)];
      }
      const int64_t rows = p.group() * p.Nq;
      parallel_for(rows, p.threads, [&](int64_t item) {
        const int64_t h = hk * p.group() + item / p.Nq, r = item % p.Nq;
        std::vector<float> qf(static_cast<size_t>(d)), of(static_cast<size_t>(d));
        std::vector<double> s(static_cast<size_t>(nk)), o(size_t(d), 0.0);
        load_row(p.q, b, h, r, qf.data());
        const int64_t end = p.key_end(r);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t n = 0; n < end; ++n) {
          double acc = 0.0;
          for (int64_t i = 0; i < d; ++i) acc += double(qf[size_t(i)]) * K[size_t(n * d + i)];
          s[size_t(n)] = acc * double(p.scale);
          m = std::max(m, s[size_t(n)]);
        }
        double l = 0.0;
        for (int64_t n = 0; n < end; ++n) {
          const double e = std::exp(s[size_t(n)] - m);
          l += e;
          for (int64_t i = 0; i < d; ++i) o[size_t(i)] += e * V[size_t(n * d + i)];
        }
        for (int64_t i = 0; i < d; ++i) of[size_t(i)] = end > 0 ? float(o[size_t(i)] / l) : 0.0f;
        store_row(p.out, b, h, r, of.data());
        if (float* lse = p.lse_at(b, h, r)) *lse = end > 0 ? float(m + std::log(l)) : -std::numeric_limits<float>::infinity();
      });
    }
  }
}

}  // namespace dmattn::cpu
