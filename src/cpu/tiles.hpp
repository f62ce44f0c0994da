// The CPU DMA engine's building blocks, shared by prefill (dma.cpp) and decode over the KV cache
// (decode.cpp): keys and values of one (batch, kv head) in compute form, and the online-softmax step
// of one query row over one 128-key tile. One implementation, so decode and prefill round alike.
#pragma once
#include <cstdint>
#include <limits>
#include <vector>

#include "dmattn/format.hpp"
#include "dmattn/policy.hpp"

namespace dmattn::cpu {

constexpr int kPVBlock = 32;  // MXFP8 block along keys for pv = mxfp8

// The per-channel mean of rows x [n, d], accumulated in fp64 and rounded once to fp32 (smooth_k's
// and smooth_q's means).
std::vector<float> channel_mean(const float* x, int64_t n, int d);
// smooth_q's mean of n query rows x [n, d] as read: their channel mean, then rotated where `rotate`
// (in real arithmetic the mean of the rotated rows; this way the GPU adds rows instead of rotating
// each one).
std::vector<float> query_mean(const float* x, int64_t n, int d, bool rotate);
// smooth_q's correction: mu.k for each of the n keys k [n, d], in fp64 (dot_f64), zeros up to `padded`.
std::vector<float> mean_dots(const std::vector<float>& mu, const float* k, int64_t n, int d, int64_t padded);
// The key side of the accuracy transforms on K's n rows of one (batch, kv head), [n][d], in place:
// each row rotated (Policy::rotate), then smooth_k's per-channel mean over the n rows subtracted,
// then every value rounded to bf16 where any transform is on. Returns the mean (zeros without
// smooth_k), from which the LSE's shift comes.
std::vector<float> transform_keys(float* k, int64_t n, int d, const Policy& pol);
// dot(a, b) over d channels, accumulated in fp64 and rounded once to fp32 (the transforms' exact
// terms: sink scores, smooth_q's mu.k, smooth_k's LSE shift).
float dot_f64(const float* a, const float* b, int d);

// Policy::q_residual on one query row x[d] quantized as elements qe[d] and block scales qs[d / blk]
// (quantize_row_values): each element gains its residual x - qe * qs rounded to E4M3 at the row's
// largest block scale, expressed at its own block's scale (a power-of-two shift: exact in fp32), so
// the tiles' arithmetic takes the two terms as one.
void add_query_residual(const float* x, int d, int blk, float* qe, const float* qs);

// One format's keys for one (batch, kv head), tile-major and transposed so that the inner loops run
// over the 128 keys of a tile with unit stride. Keys past Nk are zero.
struct KeyTiles {
  int blk = 32, nblk = 0;
  std::vector<float> kt;  // [tiles][d][T] element values
  std::vector<float> st;  // [tiles][nblk][T] block scales
};

// V for one (batch, kv head), row-major [tiles*T][d], zero past Nk; for pv = mxfp8 / mxfp4 also the
// scales of the 32-key blocks of each column, [tiles*T/32][d]; for pv = fp8 one scale a column, [d].
struct ValueRows {
  std::vector<float> v;
  std::vector<float> s;
};

// Keys [nk, d] (row-major floats) in format f, as KeyTiles; NVFP4 with each key's own second scale.
KeyTiles prepare_keys(const std::vector<float>& kf, int64_t nk, int d, Format f, ScaleRule rule, int threads);
// Values [nk, d] for P.V in precision pv.
ValueRows prepare_values(const std::vector<float>& vf, int64_t nk, int d, PV pv, ScaleRule rule, int threads);

// What a row's scores take besides Q.K^T of the quantized rows (accuracy transforms): `add[n]`
// (smooth_q's mu.k) added to the tile's key n, and the first `exact` keys of the tile replaced by
// exact_s[n] (sink keys scored from unquantized rows). Both before the softmax scale.
struct ScoreFix {
  const float* add = nullptr;
  int exact = 0;
  const float* exact_s = nullptr;
};

// One query row (elements qe[d], block scales qs in K's format) against key tile `ktile` of K and
// value tile `vtile` of V, keys [first, nvalid) of the tile visible: the online-softmax update of the row's running max
// m, sum l and unnormalised output acc[d] (tiles must come in ascending key order).
void online_tile(const float* qe, const float* qs, const KeyTiles& K, int64_t ktile, const ValueRows& V,
                 int64_t vtile, int nvalid, int d, float scale, PV pv, ScaleRule rule, float& m, float& l, float* acc,
                 const ScoreFix& fix = {}, int first = 0);

// One row's unnormalised partial result over some of its keys (split-KV, ring steps): running
// max m, sum l and P.V acc[d]; m = -inf while it has seen no key.
struct Partial {
  float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
  std::vector<float> acc;
  explicit Partial(int d) : acc(static_cast<size_t>(d), 0.0f) {}
};

// a <- the LSE merge of a and b. Merging into an empty partial copies, so one partial passes
// through unchanged (a single split or ring step reproduces the single pass bit for bit).
void merge(Partial& a, const Partial& b);

}  // namespace dmattn::cpu
