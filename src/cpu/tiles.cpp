#include "cpu/tiles.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/quantize.hpp"
#include "dmattn/rotation.hpp"

namespace dmattn::cpu {

std::vector<float> channel_mean(const float* x, int64_t n, int d) {
  std::vector<double> acc(static_cast<size_t>(d), 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < d; ++i) acc[size_t(i)] += x[r * d + i];
  std::vector<float> mean(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) mean[size_t(i)] = float(acc[size_t(i)] / double(n));
  return mean;
}

std::vector<float> query_mean(const float* x, int64_t n, int d, bool rotate) {
  std::vector<float> mean = channel_mean(x, n, d);
  if (rotate) rotate_row(mean.data(), d);
  return mean;
}

std::vector<float> mean_dots(const std::vector<float>& mu, const float* k, int64_t n, int d, int64_t padded) {
  std::vector<float> out(static_cast<size_t>(padded), 0.0f);
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = dot_f64(mu.data(), k + i * d, d);
  return out;
}

std::vector<float> transform_keys(float* k, int64_t n, int d, const Policy& pol) {
  std::vector<float> mean(static_cast<size_t>(d), 0.0f);
  if (pol.transforms().empty()) return mean;
  if (pol.rotate)
    for (int64_t r = 0; r < n; ++r) rotate_row(k + r * d, d);
  if (pol.smooth_k) {
    mean = channel_mean(k, n, d);
    for (int64_t r = 0; r < n; ++r)
      for (int i = 0; i < d; ++i) k[r * d + i] -= mean[size_t(i)];
  }
  for (int64_t i = 0; i < n * d; ++i) k[i] = round_bf16(k[i]);  // transformed rows enter quantization as bf16
  return mean;
}

float dot_f64(const float* a, const float* b, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += double(a[i]) * b[i];
  return float(s);
}
namespace {

constexpr int T = kTile;

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
  if (pv == PV::fp8) {  // one product over the tile; the channel scales and P's 2^-8 applied once (exact: powers of two)
    float t[256];  // head dims are at most 256 (head_dim_supported)
    std::fill(t, t + d, 0.0f);
    for (int n = 0; n < nvalid; ++n) {
      const float pe = decode_elem(Elem::e4m3, encode_elem(Elem::e4m3, std::ldexp(p[n], kPvFp8Shift)));
      if (pe == 0.0f) continue;
      const float* vr = vt + n * d;
      for (int i = 0; i < d; ++i) t[i] += pe * vr[i];
    }
    for (int i = 0; i < d; ++i) acc[i] += t[i] * std::ldexp(V.s[size_t(i)], -kPvFp8Shift);
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

void add_query_residual(const float* x, int d, int blk, float* qe, const float* qs) {
  float top = 0.0f;
  for (int c = 0; c < d / blk; ++c) top = std::max(top, qs[c]);
  if (top == 0.0f) return;  // a zero row: no residual
  for (int i = 0; i < d; ++i) {
    const float s = qs[i / blk], r = x[i] - qe[i] * s;
    qe[i] += decode_elem(Elem::e4m3, encode_elem(Elem::e4m3, r / top)) * (top / s);
  }
}

KeyTiles prepare_keys(const std::vector<float>& kf, int64_t nk, int d, Format f, ScaleRule rule, int threads) {
  KeyTiles K;
  K.blk = value_block(f);
  K.nblk = d / K.blk;
  const int64_t tiles = (nk + T - 1) / T;
  K.kt.assign(size_t(tiles * d * T), 0.0f);
  K.st.assign(size_t(tiles * K.nblk * T), 0.0f);
  parallel_for(tiles, threads, [&](int64_t j) {
    std::vector<float> e(static_cast<size_t>(d)), s(size_t(K.nblk));
    for (int64_t n = j * T; n < std::min<int64_t>(nk, (j + 1) * T); ++n) {
      const float* row = kf.data() + n * d;
      // NVFP4 tiles scale each key by its own fp32 second scale (the row's amax mapped onto E4M3 x E2M1).
      const float ts = f == Format::nvfp4 ? nvfp4_tensor_scale(abs_max(row, d)) : 1.0f;
      quantize_row_values(row, d, f, rule, ts, e.data(), s.data());
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
  if (pv == PV::fp8) {  // each channel as one MX block over the nk keys: one E8M0 scale, E4M3 codes
    V.s.assign(size_t(d), 0.0f);
    parallel_for(d, threads, [&](int64_t i) {
      std::vector<float> col(static_cast<size_t>(nk));
      std::vector<uint8_t> codes(static_cast<size_t>(nk));
      for (int64_t n = 0; n < nk; ++n) col[size_t(n)] = vf[size_t(n * d + i)];
      V.s[size_t(i)] = decode_e8m0(quantize_mx_block(col.data(), int(nk), Elem::e4m3, rule, codes.data()));
      for (int64_t n = 0; n < nk; ++n) V.v[size_t(n * d + i)] = decode_elem(Elem::e4m3, codes[size_t(n)]);
    });
    return V;
  }
  const int64_t blocks = tiles * T / kPVBlock;
  V.s.assign(size_t(blocks * d), 0.0f);
  const Format vfmt = pv_values_format(pv);
  parallel_for(blocks, threads, [&](int64_t kb) {
    float col[kPVBlock], e[kPVBlock], s;
    for (int i = 0; i < d; ++i) {
      for (int t = 0; t < kPVBlock; ++t) {
        const int64_t n = kb * kPVBlock + t;
        col[t] = n < nk ? vf[size_t(n * d + i)] : 0.0f;
      }
      quantize_row_values(col, kPVBlock, vfmt, rule, 1.0f, e, &s);
      for (int t = 0; t < kPVBlock; ++t) V.v[size_t((kb * kPVBlock + t) * d + i)] = e[t];
      V.s[size_t(kb * d + i)] = s;
    }
  });
  return V;
}

void online_tile(const float* qe, const float* qs, const KeyTiles& K, int64_t ktile, const ValueRows& V,
                 int64_t vtile, int nvalid, int d, float scale, PV pv, ScaleRule rule, float& m, float& l, float* acc,
                 const ScoreFix& fix, int first) {
  float s[T], pr[T];
  score_row(qe, qs, K, ktile, d, s);
  if (fix.add)
    for (int n = 0; n < T; ++n) s[n] += fix.add[n];
  for (int n = 0; n < std::min(fix.exact, T); ++n) s[n] = fix.exact_s[n];
  float mt = -std::numeric_limits<float>::infinity();
  for (int n = first; n < nvalid; ++n) {
    s[n] *= scale;
    mt = std::max(mt, s[n]);
  }
  const float mnew = std::max(m, mt);
  const float alpha = std::exp(m - mnew);
  float psum = 0.0f;
  for (int n = 0; n < T; ++n) {
    pr[n] = n >= first && n < nvalid ? std::exp(s[n] - mnew) : 0.0f;
    psum += pr[n];
  }
  l = l * alpha + psum;
  m = mnew;
  for (int i = 0; i < d; ++i) acc[i] *= alpha;
  accumulate_pv(pr, nvalid, V, vtile, d, pv, rule, acc);
}

void merge(Partial& a, const Partial& b) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (b.m == kNegInf) return;
  if (a.m == kNegInf) {
    a = b;
    return;
  }
  const float M = std::max(a.m, b.m), wa = std::exp(a.m - M), wb = std::exp(b.m - M);
  a.l = a.l * wa + b.l * wb;
  for (size_t i = 0; i < a.acc.size(); ++i) a.acc[i] = a.acc[i] * wa + b.acc[i] * wb;
  a.m = M;
}

}  // namespace dmattn::cpu
