// DMA attention on the CPU: the oracle every GPU kernel is compared against (semantics in
// include/dmattn/attention.hpp). Work is split by (batch, kv head) and then by (query head,
// 128-row chunk); each output row is computed by one thread in one fixed order, so results do not
// depend on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "cpu/tiles.hpp"
#include "problem.hpp"
#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/quantize.hpp"

namespace dmattn::cpu {
namespace {

constexpr int T = kTile;

// The formats a problem uses: slot 0 = high, slot 1 = low (the same when high == low).
struct Slots {
  Format fmt[2];
  int count;
  explicit Slots(const Policy& pol) : fmt{pol.high, pol.low}, count(pol.high == pol.low ? 1 : 2) {}
  int high() const { return 0; }
  int low() const { return count - 1; }
};

}  // namespace

void dma_attention(const Problem& p) {
  const int d = int(p.d);
  const Slots slots(p.policy);
  const ScaleRule rule = p.policy.scale_rule;
  const int64_t row_chunks = (p.Nq + T - 1) / T;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      std::vector<float> kf(size_t(p.Nk * d)), vf(size_t(p.Nk * d));
      for (int64_t n = 0; n < p.Nk; ++n) {
        load_row(p.k, b, hk, n, kf.data() + n * d);
        load_row(p.v, b, hk, n, vf.data() + n * d);
      }
      // smooth_k: K minus its per-channel mean (accumulated in fp64, rounded once to fp32).
      std::vector<float> kmean(static_cast<size_t>(d), 0.0f);
      if (p.policy.smooth_k) {
        std::vector<double> acc(static_cast<size_t>(d), 0.0);
        for (int64_t n = 0; n < p.Nk; ++n)
          for (int i = 0; i < d; ++i) acc[size_t(i)] += kf[size_t(n * d + i)];
        for (int i = 0; i < d; ++i) kmean[size_t(i)] = float(acc[size_t(i)] / double(p.Nk));
        for (int64_t n = 0; n < p.Nk; ++n)
          for (int i = 0; i < d; ++i) kf[size_t(n * d + i)] -= kmean[size_t(i)];
      }
      KeyTiles keys[2];
      for (int s = 0; s < slots.count; ++s) keys[s] = prepare_keys(kf, p.Nk, d, slots.fmt[s], rule, p.threads);
      const ValueRows values = prepare_values(vf, p.Nk, d, p.policy.pv, rule, p.threads);

      // NVFP4's tensor scale of Q is per (batch, query head): one pass over each head first.
      std::vector<float> q_tensor_scale(size_t(p.group()), 1.0f);
      if (slots.fmt[0] == Format::nvfp4 || slots.fmt[slots.low()] == Format::nvfp4) {
        std::vector<float> row(static_cast<size_t>(d));
        for (int64_t g = 0; g < p.group(); ++g) {
          float amax = 0.0f;
          for (int64_t r = 0; r < p.Nq; ++r) {
            load_row(p.q, b, hk * p.group() + g, r, row.data());
            amax = std::max(amax, abs_max(row.data(), d));
          }
          q_tensor_scale[size_t(g)] = nvfp4_tensor_scale(amax);
        }
      }

      parallel_for(p.group() * row_chunks, p.threads, [&](int64_t item) {
        const int64_t g = item / row_chunks, h = hk * p.group() + g;
        const int64_t r0 = (item % row_chunks) * T, rows = std::min<int64_t>(T, p.Nq - r0);
        // Q rows of this chunk in each format.
        std::vector<float> qe[2], qs[2], qf(static_cast<size_t>(d));
        for (int s = 0; s < slots.count; ++s) {
          qe[s].resize(size_t(rows * d));
          qs[s].resize(size_t(rows * keys[s].nblk));
        }
        std::vector<float> lse_shift(static_cast<size_t>(rows), 0.0f);  // scale * q.mean(K), smooth_k only
        for (int64_t ri = 0; ri < rows; ++ri) {
          load_row(p.q, b, h, r0 + ri, qf.data());
          if (p.policy.smooth_k) {
            double dot = 0;
            for (int i = 0; i < d; ++i) dot += double(qf[size_t(i)]) * kmean[size_t(i)];
            lse_shift[size_t(ri)] = float(dot * p.scale);
          }
          for (int s = 0; s < slots.count; ++s)
            quantize_row_values(qf.data(), d, slots.fmt[s], rule, q_tensor_scale[size_t(g)], qe[s].data() + ri * d,
                                qs[s].data() + ri * keys[s].nblk);
        }
        std::vector<float> m(size_t(rows), kNegInf), l(size_t(rows), 0.0f), acc(size_t(rows * d), 0.0f);
        int64_t tiles = 0;
        for (int64_t ri = 0; ri < rows; ++ri) tiles = std::max(tiles, (p.key_end(r0 + ri) + T - 1) / T);
        for (int64_t j = 0; j < tiles; ++j) {
          for (int64_t ri = 0; ri < rows; ++ri) {
            const int64_t r = r0 + ri, kend = p.key_end(r);
            if (j * T >= kend) continue;
            const int slot = p.policy.is_high(p.query_tile(r), p.key_tile0() + j) ? slots.high() : slots.low();
            const int nvalid = int(std::min<int64_t>(T, kend - j * T));
            online_tile(qe[slot].data() + ri * d, qs[slot].data() + ri * keys[slot].nblk, keys[slot], j, values, j,
                        nvalid, d, p.scale, p.policy.pv, rule, m[size_t(ri)], l[size_t(ri)], acc.data() + ri * d);
          }
        }
        for (int64_t ri = 0; ri < rows; ++ri) {
          float* a = acc.data() + ri * d;
          const float li = l[size_t(ri)];
          // Finite inputs can still overflow fp32 scores (|q.k| > 3.4e38): say so, never emit NaN.
          // Unchecked inputs (check_finite off) may hold NaN/Inf: their rows come out NaN.
          const bool broken = p.key_end(r0 + ri) > 0 && !(std::isfinite(m[size_t(ri)]) && std::isfinite(li));
          if (broken && p.check_finite)
            throw Error("attention scores overflow fp32 at head " + std::to_string(h) + ", row " +
                        std::to_string(r0 + ri) + ": inputs too large for the fp32 score accumulator");
          constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
          for (int i = 0; i < d; ++i) a[i] = broken ? kNaN : li > 0.0f ? a[i] / li : 0.0f;
          store_row(p.out, b, h, r0 + ri, a);
          if (float* lse = p.lse_at(b, h, r0 + ri))
            *lse = broken ? kNaN : li > 0.0f ? m[size_t(ri)] + std::log(li) + lse_shift[size_t(ri)] : kNegInf;
        }
      });
    }
  }
}

}  // namespace dmattn::cpu
