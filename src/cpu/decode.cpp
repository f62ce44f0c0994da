// Decode attention over the KV cache on the CPU (semantics in include/dmattn/kv_cache.hpp): the
// oracle for a GPU split-KV decode. Pages are decoded from their stored codes once per (sequence,
// kv head); each query row runs the prefill engine's online-softmax step (cpu/tiles.hpp) over the
// pages of each split in ascending order, and the splits merge by LSE.
#include <algorithm>
#include <cmath>
#include <string>

#include "core/mask.hpp"
#include "cpu/parallel.hpp"
#include "cpu/tiles.hpp"
#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/quantize.hpp"
#include "dmattn/rotation.hpp"
#include "problem.hpp"

namespace dmattn {
namespace {
constexpr int64_t T = kTile;

// One page of one head in the engine's compute form (a single key tile).
struct PageTiles {
  Format format{};
  cpu::KeyTiles keys;
  cpu::ValueRows values;
};

PageTiles unpack(const KVCache::Page& pg, int64_t h, int64_t d, PV pv) {
  PageTiles t;
  t.format = pg.format;
  const FormatInfo fi = format_info(pg.format);
  const bool packed = fi.elem == Elem::e2m1;
  const int64_t cb = packed ? d / 2 : d, nb = d / 32;
  t.keys.blk = 32;
  t.keys.nblk = int(nb);
  t.keys.kt.assign(size_t(d * T), 0.0f);
  t.keys.st.assign(size_t(nb * T), 0.0f);
  for (int64_t n = 0; n < T; ++n) {
    const uint8_t* codes = pg.codes.data() + (h * T + n) * cb;
    for (int64_t k = 0; k < d; ++k) t.keys.kt[size_t(k * T + n)] = decode_elem(fi.elem, element_code(codes, k, packed));
    for (int64_t c = 0; c < nb; ++c) t.keys.st[size_t(c * T + n)] = decode_e8m0(pg.scales[size_t((h * T + n) * nb + c)]);
  }
  t.values.v.resize(size_t(T * d));
  if (!pg.v.empty()) {  // pv = bf16
    for (int64_t i = 0; i < T * d; ++i) t.values.v[size_t(i)] = to_float(bf16{pg.v[size_t(h * T * d + i)]});
    return t;
  }
  // pv = mxfp8 / mxfp4: element values and the scales of each 32-key block per channel.
  const Elem ve = format_info(pv_values_format(pv)).elem;
  const bool vpacked = ve == Elem::e2m1;
  for (int64_t n = 0; n < T; ++n) {
    const uint8_t* codes = pg.v8.data() + (h * T + n) * (vpacked ? d / 2 : d);
    for (int64_t c = 0; c < d; ++c) t.values.v[size_t(n * d + c)] = decode_elem(ve, element_code(codes, c, vpacked));
  }
  t.values.s.resize(size_t(T / 32 * d));
  for (int64_t i = 0; i < T / 32 * d; ++i) t.values.s[size_t(i)] = decode_e8m0(pg.vs[size_t(h * (T / 32) * d + i)]);
  return t;
}
}  // namespace

void decode_attention(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                      float* lse, const DecodeOptions& opts) {
  const int64_t S = int64_t(seqs.size()), Hkv = cache.kv_heads(), d = cache.head_dim();
  const int64_t Hq = q.shape[1], Nq = q.shape[2];
  if (q.device != out.device) throw Error("decode_attention: q and out must live on the same device");
  if (q.shape[0] != S || q.shape[3] != d || Hq < 1 || Hq % Hkv != 0)
    throw Error("decode_attention: q must be [" + std::to_string(S) + ", a multiple of " + std::to_string(Hkv) +
                ", Nq, " + std::to_string(d) + "]");
  if (Nq < 1 || Nq > 16) throw Error("decode_attention: 1 to 16 new queries per sequence (got " + std::to_string(Nq) + ")");
  if (out.shape != q.shape) throw Error("decode_attention: out must have q's shape");
  if (opts.splits < 0) throw Error("decode_attention: splits must be >= 0 (0 = automatic)");
  for (int s : seqs)
    if (cache.length(s) < Nq)
      throw Error("decode_attention: sequence " + std::to_string(s) + " holds " + std::to_string(cache.length(s)) +
                  " tokens, fewer than the " + std::to_string(Nq) + " queries (append their keys first)");
  const float scale = opts.softmax_scale.value_or(1.0f / std::sqrt(float(d)));
  if (!(scale > 0.0f && std::isfinite(scale))) throw Error("decode_attention: softmax_scale must be positive and finite");
  if (q.device == Device::cuda) {
#if defined(DMATTN_HAVE_CUDA)
    cuda::decode_attention(cache, seqs, q, out, lse, scale, opts);
    return;
#else
    throw Error("decode_attention: CUDA tensors, but this build has no CUDA backend (configure with -DDMATTN_CUDA=ON)");
#endif
  }
  const Policy& pol = cache.policy();
  const int64_t group = Hq / Hkv;
  const bool transformed = !pol.transforms().empty();
  const float kscale = rotated_scale(scale, int(d), pol.rotate);

  cpu::parallel_for(S * Hkv, opts.threads, [&](int64_t item) {
    const int64_t si = item / Hkv, hk = item % Hkv;
    const int64_t L = cache.length(seqs[size_t(si)]);
    const std::vector<int32_t>& table = cache.page_table(seqs[size_t(si)]);
    std::vector<PageTiles> pages;
    pages.reserve(table.size());
    for (int32_t p : table) pages.push_back(unpack(cache.page(p), hk, d, cache.policy().pv));
    const int64_t np = int64_t(pages.size());
    // The splits divide pages [jlo, np): jlo is the first page the earliest row's window reaches (the
    // CUDA decode reads no page before it and partitions the same way).
    const int64_t jlo = opts.window_left < 0 ? 0 : std::max<int64_t>(0, L - Nq - opts.window_left) / T;
    const int64_t splits = std::min<int64_t>(std::max(opts.splits, 1), np - jlo);
    // The transforms' per-sequence state: K's mean (smooth_k) and the sink keys' rows.
    const int seq = seqs[size_t(si)];
    const std::vector<float> kmeans = cache.key_mean(seq), sinks = cache.sink_rows(seq);
    const float* kmean = pol.smooth_k ? kmeans.data() + hk * d : nullptr;
    const float* sink = pol.sink_keys > 0 ? sinks.data() + hk * pol.sink_keys * d : nullptr;
    std::vector<float> qf(static_cast<size_t>(d)), qorig, exact(size_t(std::max(pol.sink_keys, 0))), qe[2], qs[2];
    const Format fmt[2] = {pol.high, pol.low};
    for (int s = 0; s < 2; ++s) {
      qe[s].resize(size_t(d));
      qs[s].resize(size_t(d / 32));
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = hk * group + g;
      for (int64_t r = 0; r < Nq; ++r) {
        load_row(q, si, h, r, qf.data());
        for (float x : qf)
          if (!std::isfinite(x)) throw Error("decode_attention: q holds a non-finite value");
        // q as prefill quantizes it: rotated, then rounded to bf16 when transformed; qorig keeps the
        // rotated fp32 row for the exact terms.
        if (pol.rotate) rotate_row(qf.data(), int(d));
        qorig = qf;
        if (transformed)
          for (float& x : qf) x = round_bf16(x);
        // Row r sits at position L - Nq + r (bottom-right) and sees keys [kbegin, kend) (src/core/mask.hpp).
        const Mask mask{L, true, opts.window_left < 0 ? -1 : opts.window_left, -1};
        const int64_t kend = mask.key_end(L - Nq + r), kbegin = mask.key_begin(L - Nq + r);
        // Sink keys scored exactly: the sequence's first min(sink_keys, L) keys.
        const int64_t nexact = sink ? std::min<int64_t>(pol.sink_keys, L) : 0;
        for (int64_t n = 0; n < nexact; ++n) exact[size_t(n)] = cpu::dot_f64(qorig.data(), sink + n * d, int(d));
        auto fix_of = [&](int64_t j) {
          cpu::ScoreFix fix;
          if (j * T < nexact) {
            fix.exact = int(std::min<int64_t>(T, nexact - j * T));
            fix.exact_s = exact.data() + j * T;
          }
          return fix;
        };
        for (int s = 0; s < 2; ++s)
          quantize_row_values(qf.data(), int(d), fmt[s], pol.scale_rule, 1.0f, qe[s].data(), qs[s].data());
        if (pol.q_residual) cpu::add_query_residual(qf.data(), int(d), value_block(fmt[0]), qe[0].data(), qs[0].data());
        // Each split's pages in ascending order, then the LSE merge of the splits in order (one
        // split passes through unchanged: prefill's arithmetic exactly).
        cpu::Partial total{int(d)};
        for (int64_t sp = 0; sp < splits; ++sp) {
          cpu::Partial part{int(d)};
          for (int64_t j = jlo + sp * (np - jlo) / splits; j < jlo + (sp + 1) * (np - jlo) / splits; ++j) {
            if (j * T >= kend) break;
            if ((j + 1) * T <= kbegin) continue;  // wholly before the window
            const PageTiles& pt = pages[size_t(j)];
            const int slot = pt.format == pol.high ? 0 : 1;
            const int nvalid = int(std::min<int64_t>(T, kend - j * T));
            cpu::online_tile(qe[slot].data(), qs[slot].data(), pt.keys, 0, pt.values, 0, nvalid, int(d), kscale, pol.pv,
                             pol.scale_rule, part.m, part.l, part.acc.data(), fix_of(j),
                             int(std::max<int64_t>(0, kbegin - j * T)));
          }
          cpu::merge(total, part);
        }
        if (!(std::isfinite(total.m) && std::isfinite(total.l) && total.l > 0.0f))
          throw Error("decode_attention: scores overflow fp32 (sequence " + std::to_string(seqs[size_t(si)]) + ")");
        for (float& x : total.acc) x /= total.l;
        store_row(out, si, h, r, total.acc.data());
        // smooth_k shifted every score by q.mean(K): LSE is reported unshifted.
        const float shift = kmean ? cpu::dot_f64(qorig.data(), kmean, int(d)) * kscale : 0.0f;
        if (lse) lse[(si * Hq + h) * Nq + r] = total.m + std::log(total.l) + shift;
      }
    }
  });
}

#if !defined(DMATTN_HAVE_CUDA)
double decode_on_device(const KVCache&, const std::vector<int>&, const TensorView&, const TensorView&, float*,
                        const DecodeOptions&) {
  throw Error("this build has no CUDA backend (configure with -DDMATTN_CUDA=ON on a machine with nvcc)");
}
#endif

}  // namespace dmattn
