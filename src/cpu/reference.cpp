// The exact reference: softmax(Q K^T * scale) V with every product and sum in fp64. K is kept
// transposed in 128-key tiles so that the score loop runs over keys with unit stride (vectorised,
// each dot still summed over d in order).
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "problem.hpp"

namespace dmattn::cpu {

void exact_attention(const Problem& p) {
  constexpr int T = kTile;
  const int64_t d = p.d, nk = p.Nk, tiles = (nk + T - 1) / T;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      std::vector<double> KT(size_t(tiles * d * T), 0.0), V(size_t(nk * d));
      std::vector<float> row(static_cast<size_t>(d));
      for (int64_t n = 0; n < nk; ++n) {
        load_row(p.k, b, hk, n, row.data());
        for (int64_t i = 0; i < d; ++i) KT[size_t(((n / T) * d + i) * T + n % T)] = row[size_t(i)];
        load_row(p.v, b, hk, n, row.data());
        for (int64_t i = 0; i < d; ++i) V[size_t(n * d + i)] = row[size_t(i)];
      }
      const int64_t rows = p.group() * p.Nq;
      parallel_for(rows, p.threads, [&](int64_t item) {
        const int64_t h = hk * p.group() + item / p.Nq, r = item % p.Nq;
        std::vector<float> qf(static_cast<size_t>(d)), of(static_cast<size_t>(d));
        std::vector<double> s(size_t(tiles * T)), o(static_cast<size_t>(d), 0.0);
        load_row(p.q, b, h, r, qf.data());
        const int64_t begin = p.key_begin(r), end = p.key_end(r);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = begin / T; j * T < end; ++j) {
          double* sj = s.data() + j * T;
          for (int n = 0; n < T; ++n) sj[n] = 0.0;
          const double* kt = KT.data() + j * d * T;
          for (int64_t i = 0; i < d; ++i) {
            const double qi = qf[size_t(i)];
            for (int n = 0; n < T; ++n) sj[n] += qi * kt[i * T + n];
          }
          for (int64_t n = std::max(begin, j * T); n < std::min(end, (j + 1) * T); ++n) {
            s[size_t(n)] *= double(p.scale);
            m = std::max(m, s[size_t(n)]);
          }
        }
        double l = 0.0;
        for (int64_t n = begin; n < end; ++n) {
          const double e = std::exp(s[size_t(n)] - m);
          l += e;
          const double* vr = V.data() + n * d;
          for (int64_t i = 0; i < d; ++i) o[size_t(i)] += e * vr[i];
        }
        for (int64_t i = 0; i < d; ++i) of[size_t(i)] = end > begin ? float(o[size_t(i)] / l) : 0.0f;
        store_row(p.out, b, h, r, of.data());
        if (float* lse = p.lse_at(b, h, r)) *lse = end > begin ? float(m + std::log(l)) : -std::numeric_limits<float>::infinity();
      });
    }
  }
}

}  // namespace dmattn::cpu
