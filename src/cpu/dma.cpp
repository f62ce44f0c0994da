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
#include "dmattn/rotation.hpp"

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
  const Policy& pol = p.policy;
  const Slots slots(pol);
  const ScaleRule rule = pol.scale_rule;
  const int64_t row_chunks = (p.Nq + T - 1) / T;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float scale = rotated_scale(p.scale, d, pol.rotate);
  // Local indices of the keys scored exactly: absolute positions below sink_keys.
  const int64_t exact_keys = std::clamp<int64_t>(pol.sink_keys - p.k_pos0, 0, p.Nk);
  const bool transformed = !pol.transforms().empty();

  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      std::vector<float> kf(size_t(p.Nk * d)), vf(size_t(p.Nk * d));
      for (int64_t n = 0; n < p.Nk; ++n) {
        load_row(p.k, b, hk, n, kf.data() + n * d);
        load_row(p.v, b, hk, n, vf.data() + n * d);
      }
      const std::vector<float> kmean = transform_keys(kf.data(), p.Nk, d, pol);
      KeyTiles keys[2];
      for (int s = 0; s < slots.count; ++s) keys[s] = prepare_keys(kf, p.Nk, d, slots.fmt[s], rule, p.threads);
      const ValueRows values = prepare_values(vf, p.Nk, d, pol.pv, rule, p.threads);

      // Q of each head of the group as it is quantized: rotated, then rounded to bf16 when
      // transformed (qt[g]); where smooth_q centres a slot's tiles, that slot quantizes the rows less
      // the head's mean mu (query_mean), then rounded (qc[g]); qfull keeps the rotated rows in fp32
      // (exact sink scores, the LSE shift).
      const int64_t G = p.group();
      // ds[g]: smooth_q's mu.k for every key of head g (zero past Nk), added to the centred tiles' scores.
      std::vector<std::vector<float>> qt(static_cast<size_t>(G)), qc(static_cast<size_t>(G)),
          qfull(static_cast<size_t>(G)), ds(static_cast<size_t>(G));
      const bool smooth_q = pol.smooth_q != SmoothQ::off;
      parallel_for(G, p.threads, [&](int64_t g) {
        std::vector<float>& x = qfull[size_t(g)];
        x.resize(size_t(p.Nq * d));
        for (int64_t r = 0; r < p.Nq; ++r) load_row(p.q, b, hk * G + g, r, x.data() + r * d);
        std::vector<float> mu;
        if (smooth_q) mu = query_mean(x.data(), p.Nq, d, pol.rotate);
        if (pol.rotate)
          for (int64_t r = 0; r < p.Nq; ++r) rotate_row(x.data() + r * d, d);
        auto rounded = [&](std::vector<float> y) {
          if (transformed)
            for (float& v : y) v = round_bf16(v);
          return y;
        };
        if (pol.smooth_q != SmoothQ::all) qt[size_t(g)] = rounded(x);
        if (smooth_q) {
          std::vector<float> c = x;
          for (int64_t r = 0; r < p.Nq; ++r)
            for (int i = 0; i < d; ++i) c[size_t(r * d + i)] -= mu[size_t(i)];
          qc[size_t(g)] = rounded(std::move(c));
          ds[size_t(g)] = mean_dots(mu, kf.data(), p.Nk, d, (p.Nk + T - 1) / T * T);
        }
      });
      // The rows each slot quantizes.
      bool centred[2];
      for (int s = 0; s < slots.count; ++s) centred[s] = pol.smooths_q(s == slots.high());

      parallel_for(G * row_chunks, p.threads, [&](int64_t item) {
        const int64_t g = item / row_chunks, h = hk * G + g, chunk = item % row_chunks;
        const int64_t r0 = chunk * T, rows = std::min<int64_t>(T, p.Nq - r0);
        // Q rows of this chunk in each format.
        std::vector<float> qe[2], qs[2];
        for (int s = 0; s < slots.count; ++s) {
          qe[s].resize(size_t(rows * d));
          qs[s].resize(size_t(rows * keys[s].nblk));
        }
        const float* qrows[2];
        for (int s = 0; s < slots.count; ++s) qrows[s] = (centred[s] ? qc : qt)[size_t(g)].data() + r0 * d;
        const float* qorig = qfull[size_t(g)].data() + r0 * d;
        std::vector<float> lse_shift(static_cast<size_t>(rows), 0.0f);  // scale * q.mean(K), smooth_k only
        for (int64_t ri = 0; ri < rows; ++ri) {
          if (pol.smooth_k) lse_shift[size_t(ri)] = dot_f64(qorig + ri * d, kmean.data(), d) * scale;
          for (int s = 0; s < slots.count; ++s)
            quantize_row_values(qrows[s] + ri * d, d, slots.fmt[s], rule,
                                slots.fmt[s] == Format::nvfp4 ? nvfp4_tensor_scale(abs_max(qrows[s] + ri * d, d)) : 1.0f,
                                qe[s].data() + ri * d,
                                qs[s].data() + ri * keys[s].nblk);
          if (pol.q_residual)
            add_query_residual(qrows[slots.high()] + ri * d, d, value_block(slots.fmt[slots.high()]),
                               qe[slots.high()].data() + ri * d, qs[slots.high()].data() + ri * keys[slots.high()].nblk);
        }
        // Sink keys scored exactly, from the rows before quantization (and before smooth_q, which
        // is an identity on exact scores).
        std::vector<float> exact(size_t(rows * exact_keys));
        for (int64_t ri = 0; ri < rows; ++ri)
          for (int64_t n = 0; n < exact_keys; ++n)
            exact[size_t(ri * exact_keys + n)] = dot_f64(qorig + ri * d, kf.data() + n * d, d);

        std::vector<float> m(size_t(rows), kNegInf), l(size_t(rows), 0.0f), acc(size_t(rows * d), 0.0f);
        int64_t tiles = 0;
        for (int64_t ri = 0; ri < rows; ++ri) tiles = std::max(tiles, (p.key_end(r0 + ri) + T - 1) / T);
        for (int64_t j = 0; j < tiles; ++j) {
          for (int64_t ri = 0; ri < rows; ++ri) {
            const int64_t r = r0 + ri, kend = p.key_end(r), kbegin = p.key_begin(r);
            if (j * T >= kend || (j + 1) * T <= kbegin) continue;  // outside the mask: skipped
            const int slot = pol.is_high(p.query_tile(r), p.key_tile0() + j) ? slots.high() : slots.low();
            const int nvalid = int(std::min<int64_t>(T, kend - j * T));
            ScoreFix fix;
            if (centred[slot]) fix.add = ds[size_t(g)].data() + j * T;
            if (j * T < exact_keys) {
              fix.exact = int(std::min<int64_t>(T, exact_keys - j * T));
              fix.exact_s = exact.data() + ri * exact_keys + j * T;
            }
            online_tile(qe[slot].data() + ri * d, qs[slot].data() + ri * keys[slot].nblk, keys[slot], j, values, j,
                        nvalid, d, scale, pol.pv, rule, m[size_t(ri)], l[size_t(ri)], acc.data() + ri * d, fix, int(std::max<int64_t>(0, kbegin - j * T)));
          }
        }
        for (int64_t ri = 0; ri < rows; ++ri) {
          float* a = acc.data() + ri * d;
          const float li = l[size_t(ri)];
          // Finite inputs can still overflow fp32 scores (|q.k| > 3.4e38): say so, never emit NaN.
          // Unchecked inputs (check_finite off) may hold NaN/Inf: their rows come out NaN.
          const bool broken = p.key_end(r0 + ri) > p.key_begin(r0 + ri) && !(std::isfinite(m[size_t(ri)]) && std::isfinite(li));
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
