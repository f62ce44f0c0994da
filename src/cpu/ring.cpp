// Ring attention with simulated ranks (see include/dmattn/ring.hpp): per rank and ring step, the
// rank's query rows against the visiting key/value shard with the CPU engine's online-softmax step
// (cpu/tiles.hpp), then an LSE merge of the steps in arrival order.
#include "dmattn/ring.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "cpu/parallel.hpp"
#include "cpu/tiles.hpp"
#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/quantize.hpp"
#include "dmattn/rotation.hpp"
#include "problem.hpp"

namespace dmattn {
namespace {
constexpr int64_t T = kTile;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace

RingPlan RingPlan::make(int64_t n, int ranks, Sharding sharding) {
  if (ranks < 1) throw Error("ring: ranks must be >= 1");
  const int64_t chunks = sharding == Sharding::zigzag ? 2 * int64_t(ranks) : ranks;
  if (n < 1 || n % (chunks * T) != 0)
    throw Error("ring: the sequence length " + std::to_string(n) + " must be a multiple of " +
                std::to_string(chunks * T) + " (" + std::to_string(chunks) + " chunks of whole 128-token tiles)");
  return RingPlan{ranks, sharding, n, n / chunks};
}

std::vector<int64_t> RingPlan::chunks_of(int rank) const {
  if (sharding == Sharding::contiguous) return {rank};
  return {rank, 2 * int64_t(ranks) - 1 - rank};
}

void ring_attention_simulated(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              float* lse, const AttentionOptions& opts, const RingPlan& plan, RingStats* stats) {
  const Problem p = validate(q, k, v, out, lse, opts);
  if (q.device != Device::cpu || k.device != Device::cpu || v.device != Device::cpu || out.device != Device::cpu)
    throw Error("ring_attention_simulated: CPU tensors only");
  if (p.Nq != plan.n || p.Nk != plan.n) throw Error("ring: q and k must both hold the plan's " + std::to_string(plan.n) + " tokens");
  for (Format f : {p.policy.high, p.policy.low})
    if (f == Format::nvfp4) throw Error("ring: nvfp4's tensor scale needs an all-reduce over the shards (not built)");
  if (p.policy.sink_keys > 0)
    throw Error("ring: sink_keys are not built into the ring schedule (rotate, smooth_k and smooth_q are)");
  if (p.window_left >= 0 || p.window_right >= 0) throw Error("ring: sliding windows are not built into the ring schedule");
  if (p.policy.pv == PV::fp8) throw Error("ring: pv=fp8's per-channel V scales need an all-reduce over the shards (not built)");
  const int d = int(p.d);
  const int R = plan.ranks;
  const Format fmt[2] = {p.policy.high, p.policy.low};
  const int nslots = p.policy.high == p.policy.low ? 1 : 2;
  if (stats) stats->tile_pairs.assign(size_t(R), 0);
  // The transforms as single-device attention applies them: K's rows through cpu::transform_keys,
  // whose smooth_k mean spans every key of the sequence (on R devices, an all-reduce of the shards'
  // sums in the order of the keys); q's rows rotated, minus smooth_q's per-head mean (an all-reduce
  // too) and rounded to bf16, the LSE shifted back by q.mean(K), the scores given mu.k' (each rank
  // computes it for the keys that visit). The rotation's factor comes out of the scale.
  const Policy& pol = p.policy;
  const bool transformed = !pol.transforms().empty();
  const float scale = rotated_scale(p.scale, d, pol.rotate);

  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      std::vector<float> kall(size_t(plan.n * d));  // the sequence's keys, as they enter quantization
      for (int64_t n = 0; n < plan.n; ++n) load_row(p.k, b, hk, n, kall.data() + n * d);
      const std::vector<float> kmean = cpu::transform_keys(kall.data(), plan.n, d, pol);
      // Each rank's shard of K and V, prepared as the rank would (its chunks, ascending).
      std::vector<cpu::KeyTiles> keys(size_t(R * 2 * 2));  // [rank][chunk slot][format slot]
      std::vector<cpu::ValueRows> values(size_t(R * 2));
      cpu::parallel_for(R, p.threads, [&](int64_t r) {
        const std::vector<int64_t> chunks = plan.chunks_of(int(r));
        for (size_t c = 0; c < chunks.size(); ++c) {
          std::vector<float> kf(size_t(plan.chunk * d)), vf(size_t(plan.chunk * d));
          std::copy_n(kall.data() + chunks[c] * plan.chunk * d, plan.chunk * d, kf.data());
          for (int64_t i = 0; i < plan.chunk; ++i) load_row(p.v, b, hk, chunks[c] * plan.chunk + i, vf.data() + i * d);
          for (int s = 0; s < nslots; ++s)
            keys[size_t((r * 2 + int64_t(c)) * 2 + s)] =
                cpu::prepare_keys(kf, plan.chunk, d, fmt[s], p.policy.scale_rule, 1);
          values[size_t(r * 2 + int64_t(c))] = cpu::prepare_values(vf, plan.chunk, d, p.policy.pv, p.policy.scale_rule, 1);
        }
      });
      // smooth_q: each head's query mean over the sequence and its mu.k' for every key.
      std::vector<std::vector<float>> qmean(size_t(p.group())), ds(size_t(p.group()));
      const bool smooth_q = pol.smooth_q != SmoothQ::off;
      bool centred[2];  // the slots whose queries smooth_q centres
      for (int s = 0; s < nslots; ++s) centred[s] = pol.smooths_q(s == 0);
      if (smooth_q)
        cpu::parallel_for(p.group(), p.threads, [&](int64_t g) {
          std::vector<float> rows(size_t(plan.n * d));
          for (int64_t n = 0; n < plan.n; ++n) load_row(p.q, b, hk * p.group() + g, n, rows.data() + n * d);
          qmean[size_t(g)] = cpu::query_mean(rows.data(), plan.n, d, pol.rotate);
          ds[size_t(g)] = cpu::mean_dots(qmean[size_t(g)], kall.data(), plan.n, d, plan.n);
        });
      std::vector<int64_t> pairs(size_t(R), 0);
      cpu::parallel_for(R * p.group(), p.threads, [&](int64_t item) {
        const int r = int(item / p.group());
        const int64_t h = hk * p.group() + item % p.group();
        std::vector<float> qf(static_cast<size_t>(d)), qe[2], qs[2];
        for (int s = 0; s < nslots; ++s) {
          qe[s].resize(size_t(d));
          qs[s].resize(size_t(d));
        }
        int64_t my_pairs = 0;
        for (int64_t qc : plan.chunks_of(r))
          for (int64_t i = 0; i < plan.chunk; ++i) {
            const int64_t pos = qc * plan.chunk + i, kend = p.key_end(pos);
            load_row(p.q, b, h, pos, qf.data());
            if (pol.rotate) rotate_row(qf.data(), d);
            const float shift = pol.smooth_k ? cpu::dot_f64(qf.data(), kmean.data(), d) * scale : 0.0f;
            for (int s = 0; s < nslots; ++s) {
              std::vector<float> y = qf;
              if (centred[s])
                for (int c = 0; c < d; ++c) y[size_t(c)] -= qmean[size_t(item % p.group())][size_t(c)];
              if (transformed)
                for (float& x : y) x = round_bf16(x);
              quantize_row_values(y.data(), d, fmt[s], p.policy.scale_rule, 1.0f, qe[s].data(), qs[s].data());
              if (s == 0 && pol.q_residual) cpu::add_query_residual(y.data(), d, value_block(fmt[s]), qe[s].data(), qs[s].data());
            }
            cpu::Partial total(d);
            for (int step = 0; step < R; ++step) {  // the shards in the order the ring delivers them
              const int src = plan.kv_source(r, step);
              cpu::Partial part(d);
              const std::vector<int64_t> kchunks = plan.chunks_of(src);
              for (size_t c = 0; c < kchunks.size(); ++c)
                for (int64_t t = 0; t < plan.chunk / T; ++t) {
                  const int64_t ktile = (kchunks[c] * plan.chunk) / T + t;
                  if (ktile * T >= kend) break;
                  if (h == hk * p.group() && i % T == 0) ++my_pairs;  // once per (query tile, key tile)
                  const int slot = nslots == 2 && !p.policy.is_high(pos / T, ktile) ? 1 : 0;
                  const int nvalid = int(std::min<int64_t>(T, kend - ktile * T));
                  const cpu::KeyTiles& K = keys[size_t((src * 2 + int64_t(c)) * 2 + slot)];
                  cpu::online_tile(qe[slot].data(), qs[slot].data(), K, t, values[size_t(src * 2 + int64_t(c))], t,
                                   nvalid, d, scale, p.policy.pv, p.policy.scale_rule, part.m, part.l,
                                   part.acc.data(),
                                   {centred[slot] ? ds[size_t(item % p.group())].data() + ktile * T : nullptr});
                }
              cpu::merge(total, part);
            }
            for (float& x : total.acc) x = total.l > 0.0f ? x / total.l : 0.0f;
            store_row(p.out, b, h, pos, total.acc.data());
            if (float* l = p.lse_at(b, h, pos)) *l = total.l > 0.0f ? total.m + std::log(total.l) + shift : kNegInf;
          }
        if (my_pairs) pairs[size_t(r)] += my_pairs;  // one writer per rank (the group's first head)
      });
      if (stats)
        for (int r = 0; r < R; ++r) stats->tile_pairs[size_t(r)] += pairs[size_t(r)];
    }
}

}  // namespace dmattn
