// DMA attention on the CPU: the oracle every GPU kernel is compared against (semantics in
// include/dmattn/attention.hpp). Work is split by (batch, kv head) and then by (query head,
// 128-row chunk); each output row is computed by one thread in one fixed order, so results do not
// depend on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "problem.hpp"
#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/quantize.hpp"

namespace dmattn::cpu {
namespace {

constexpr int T = kTile;
constexpr int kPVBlock = 32;  // MXFP8 block along keys for pv = mxfp8

// The formats a problem uses: slot 0 = high, slot 1 = low (the same when high == low).
struct Slots {
  Format fmt[2];
  int count;
  explicit Slots(const Policy& pol) : fmt{pol.high, pol.low}, count(pol.high == pol.low ? 1 : 2) {}
  int high() const { return 0; }
  int low() const { return count - 1; }
};

// One format's keys for one (batch, kv head), tile-major and transposed so that the inner loops run
// over the 128 keys of a tile with unit stride. Keys past Nk are zero.
struct KeyTiles {
  int blk = 32, nblk = 0;
  std::vector<float> kt;  // [tiles][d][T] element values
  std::vector<float> st;  // [tiles][nblk][T] block scales
};

// V for one (batch, kv head), row-major [tiles*T][d], zero past Nk; for pv = mxfp8 also the scales
// of the 32-key blocks of each column, [tiles*T/32][d].
struct ValueRows {
  std::vector<float> v;
  std::vector<float> s;
};

// s[n] = sum over blocks c of (qs[c] * st[c][n]) * (sum over k in c of qe[k] * kt[k][n]), n < T.
void score_row(const float* qe, const float* qs, const KeyTiles& K, int64_t tile, int d, float* s) {
  const float* kt = K.kt.data() + tile * d * T;
  const float* st = K.st.data() + tile * K.nblk * T;
  for (int n = 0; n < T; ++n) s[n] = 0.0f;
  for (int c = 0; c < K.nblk; ++c) {
    for (int n0 = 0; n0 < T; n0 += 32) {  // 32 keys at a time keeps the partial dots in registers
      float t[32] = {};
      for (int k = c * K.blk; k < (c + 1) * K.blk; ++k) {
        const float qk = qe[k];
        const float* row = kt + k * T + n0;
        for (int i = 0; i < 32; ++i) t[i] += qk * row[i];
      }
      const float* sc = st + c * T + n0;
      for (int i = 0; i < 32; ++i) s[n0 + i] += (qs[c] * sc[i]) * t[i];
    }
  }
}

KeyTiles prepare_keys(const std::vector<float>& kf, int64_t nk, int d, Format f, ScaleRule rule, int threads) {
  KeyTiles K;
  K.blk = value_block(f);
  K.nblk = d / K.blk;
  const int64_t tiles = (nk + T - 1) / T;
  K.kt.assign(size_t(tiles * d * T), 0.0f);
  K.st.assign(size_t(tiles * K.nblk * T), 0.0f);
  const float ts = f == Format::nvfp4 ? nvfp4_tensor_scale(abs_max(kf.data(), nk * d)) : 1.0f;
  parallel_for(tiles, threads, [&](int64_t j) {
    std::vector<float> e(static_cast<size_t>(d)), s(size_t(K.nblk));
    for (int64_t n = j * T; n < std::min<int64_t>(nk, (j + 1) * T); ++n) {
      quantize_row_values(kf.data() + n * d, d, f, rule, ts, e.data(), s.data());
      const int64_t col = n % T;
      for (int k = 0; k < d; ++k) K.kt[size_t((j * d + k) * T + col)] = e[size_t(k)];
      for (int c = 0; c < K.nblk; ++c) K.st[size_t((j * K.nblk + c) * T + col)] = s[size_t(c)];
    }
  });
  return K;
}

ValueRows prepare_values(const std::vector<float>& vf, int64_t nk, int d, PV pv, ScaleRule rule, int threads) {
  ValueRows V;
  const int64_t tiles = (nk + T - 1) / T;
  V.v.assign(size_t(tiles * T * d), 0.0f);
  if (pv == PV::bf16) {
    for (int64_t i = 0; i < nk * d; ++i) V.v[size_t(i)] = round_bf16(vf[size_t(i)]);
    return V;
  }
  const int64_t blocks = tiles * T / kPVBlock;
  V.s.assign(size_t(blocks * d), 0.0f);
  parallel_for(blocks, threads, [&](int64_t kb) {
    float col[kPVBlock], e[kPVBlock], s;
    for (int i = 0; i < d; ++i) {
      for (int t = 0; t < kPVBlock; ++t) {
        const int64_t n = kb * kPVBlock + t;
        col[t] = n < nk ? vf[size_t(n * d + i)] : 0.0f;
      }
      quantize_row_values(col, kPVBlock, Format::mxfp8_e4m3, rule, 1.0f, e, &s);
      for (int t = 0; t < kPVBlock; ++t) V.v[size_t((kb * kPVBlock + t) * d + i)] = e[t];
      V.s[size_t(kb * d + i)] = s;
    }
  });
  return V;
}

// acc[0..d) += P.V for one row and one key tile (p is zero past the row's last key).
void accumulate_pv(const float* p, int nvalid, const ValueRows& V, int64_t tile, int d, PV pv, ScaleRule rule,
                   float* acc) {
  const float* vt = V.v.data() + tile * T * d;
  if (pv == PV::bf16) {
    for (int n = 0; n < nvalid; ++n) {
      const float pb = round_bf16(p[n]);
      const float* vr = vt + n * d;
      for (int i = 0; i < d; ++i) acc[i] += pb * vr[i];
    }
    return;
  }
  float pe[T], ps[T / kPVBlock];
  quantize_row_values(p, T, Format::mxfp8_e4m3, rule, 1.0f, pe, ps);
  float t[256];  // head dims are at most 256 (head_dim_supported)
  for (int c = 0; c * kPVBlock < nvalid; ++c) {
    std::fill(t, t + d, 0.0f);
    for (int n = c * kPVBlock; n < (c + 1) * kPVBlock; ++n) {
      if (pe[n] == 0.0f) continue;  // masked keys and underflowed p add nothing
      const float* vr = vt + n * d;
      for (int i = 0; i < d; ++i) t[i] += pe[n] * vr[i];
    }
    const float* vs = V.s.data() + (tile * (T / kPVBlock) + c) * d;
    for (int i = 0; i < d; ++i) acc[i] += (ps[c] * vs[i]) * t[i];
  }
}

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
        float s[T], pr[T];
        for (int64_t j = 0; j < tiles; ++j) {
          for (int64_t ri = 0; ri < rows; ++ri) {
            const int64_t r = r0 + ri, kend = p.key_end(r);
            if (j * T >= kend) continue;
            const int slot = p.policy.is_high(p.query_tile(r), j) ? slots.high() : slots.low();
            score_row(qe[slot].data() + ri * d, qs[slot].data() + ri * keys[slot].nblk, keys[slot], j, d, s);
            const int nvalid = int(std::min<int64_t>(T, kend - j * T));
            float mt = kNegInf;
            for (int n = 0; n < nvalid; ++n) {
              s[n] *= p.scale;
              mt = std::max(mt, s[n]);
            }
            const float mnew = std::max(m[size_t(ri)], mt);
            const float alpha = std::exp(m[size_t(ri)] - mnew);
            float psum = 0.0f;
            for (int n = 0; n < T; ++n) {
              pr[n] = n < nvalid ? std::exp(s[n] - mnew) : 0.0f;
              psum += pr[n];
            }
            l[size_t(ri)] = l[size_t(ri)] * alpha + psum;
            m[size_t(ri)] = mnew;
            float* a = acc.data() + ri * d;
            for (int i = 0; i < d; ++i) a[i] *= alpha;
            accumulate_pv(pr, nvalid, values, j, d, p.policy.pv, rule, a);
          }
        }
        for (int64_t ri = 0; ri < rows; ++ri) {
          float* a = acc.data() + ri * d;
          const float li = l[size_t(ri)];
          // Finite inputs can still overflow fp32 scores (|q.k| > 3.4e38): say so, never emit NaN.
          if (p.key_end(r0 + ri) > 0 && !(std::isfinite(m[size_t(ri)]) && std::isfinite(li)))
            throw Error("attention scores overflow fp32 at head " + std::to_string(h) + ", row " +
                        std::to_string(r0 + ri) + ": inputs too large for the fp32 score accumulator");
          for (int i = 0; i < d; ++i) a[i] = li > 0.0f ? a[i] / li : 0.0f;
          store_row(p.out, b, h, r0 + ri, a);
          if (float* lse = p.lse_at(b, h, r0 + ri))
            *lse = li > 0.0f ? m[size_t(ri)] + std::log(li) + lse_shift[size_t(ri)] : kNegInf;
        }
      });
    }
  }
}

}  // namespace dmattn::cpu
