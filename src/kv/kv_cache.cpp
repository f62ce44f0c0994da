#include "dmattn/kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/capabilities.hpp"
#include "cpu/tiles.hpp"
#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/quantize.hpp"
#include "dmattn/rotation.hpp"

namespace dmattn {
namespace {
constexpr int64_t T = kTile;

int64_t code_bytes(Format f, int64_t d) { return format_info(f).elem == Elem::e2m1 ? d / 2 : d; }
}  // namespace

KVCache::KVCache(int64_t kv_heads, int64_t head_dim, const Policy& policy)
    : heads_(kv_heads), d_(head_dim), policy_(policy) {
  if (kv_heads < 1) throw Error("KVCache: kv_heads must be >= 1");
  if (!head_dim_supported(head_dim)) throw Error("KVCache: unsupported head dim " + std::to_string(head_dim));
  require(kv_cache_capabilities(), policy, head_dim);
  if (policy.sink_keys > kMaxSinkKeys)
    throw Error("KVCache: sink_keys at most " + std::to_string(kMaxSinkKeys) + " (the cache retains them in fp32)");
  policy.validate();
}

KVCache::Sequence& KVCache::seq(int id) {
  if (id < 0 || size_t(id) >= seqs_.size() || !seqs_[size_t(id)].live)
    throw Error("KVCache: no sequence " + std::to_string(id));
  return seqs_[size_t(id)];
}
const KVCache::Sequence& KVCache::seq(int id) const { return const_cast<KVCache*>(this)->seq(id); }

int KVCache::new_sequence() {
  for (size_t i = 0; i < seqs_.size(); ++i)
    if (!seqs_[i].live) {
      seqs_[i] = Sequence{};
      seqs_[i].live = true;
      return int(i);
    }
  seqs_.emplace_back();
  seqs_.back().live = true;
  return int(seqs_.size() - 1);
}

void KVCache::free_sequence(int id) {
  Sequence& s = seq(id);
  for (int32_t p : s.table) {
    const uint64_t version = pages_[size_t(p)].version;
    pages_[size_t(p)] = Page{};  // release the storage; the slot is reused
    pages_[size_t(p)].version = version + 1;  // versions never repeat: a device copy must not take it as synced
    free_pages_.push_back(p);
  }
  s = Sequence{};
}

int64_t KVCache::length(int id) const { return seq(id).length; }
const std::vector<int32_t>& KVCache::page_table(int id) const { return seq(id).table; }
std::vector<float> KVCache::key_mean(int id) const {
  const Sequence& s = seq(id);
  if (!policy_.smooth_k || s.table.empty()) return {};
  const std::vector<float>& st = pages_[size_t(s.table[0])].state;
  std::vector<float> mean;
  for (int64_t h = 0; h < heads_; ++h) mean.insert(mean.end(), st.begin() + h * state_rows() * d_, st.begin() + (h * state_rows() + 1) * d_);
  return mean;
}

std::vector<float> KVCache::sink_rows(int id) const {
  const Sequence& s = seq(id);
  if (policy_.sink_keys == 0 || s.table.empty()) return {};
  const std::vector<float>& st = pages_[size_t(s.table[0])].state;
  const int64_t first = policy_.smooth_k ? 1 : 0;
  std::vector<float> rows;
  for (int64_t h = 0; h < heads_; ++h)
    rows.insert(rows.end(), st.begin() + (h * state_rows() + first) * d_, st.begin() + (h + 1) * state_rows() * d_);
  return rows;
}

size_t KVCache::bytes(int id) const {
  size_t n = 0;
  for (int32_t p : seq(id).table) {
    const Page& pg = pages_[size_t(p)];
    n += pg.codes.size() + pg.scales.size() + pg.v.size() * sizeof(uint16_t) + pg.v8.size() + pg.vs.size() +
         (pg.kept.size() + pg.state.size()) * sizeof(float);
  }
  return n + seq(id).v_tail.size() * sizeof(float);
}

// Quantizes rows [row0, row0 + rows) of head h from k ([rows][d] floats) in the page's format.
void KVCache::encode_rows(Page& pg, int64_t h, int64_t row0, int64_t rows, const float* k) const {
  const Quantized q = quantize(k, rows, d_, pg.format, policy_.scale_rule);
  const int64_t cb = code_bytes(pg.format, d_), nb = d_ / 32;
  std::copy(q.codes.begin(), q.codes.end(), pg.codes.begin() + (h * T + row0) * cb);
  std::copy(q.scales.begin(), q.scales.end(), pg.scales.begin() + (h * T + row0) * nb);
}

void KVCache::settle(Sequence& s) {
  if (s.length == 0) return;
  const int64_t last = (s.length - 1) / T;
  for (int64_t j = 0; j <= last; ++j) {
    Page& pg = pages_[size_t(s.table[size_t(j)])];
    // The decode alignment: page j takes the format of tile (newest query tile, j).
    if (policy_.is_high(last, j) || pg.format == policy_.low) continue;
    // Left the window: re-encode K in the low format, from the retained originals (or, for the
    // comparison, from the high format's values).
    const int64_t rows = std::min<int64_t>(T, s.length - j * T);
    std::vector<float> src;
    if (reencode_from_high) {
      Quantized q;
      q.format = pg.format;
      q.rule = policy_.scale_rule;
      q.rows = heads_ * T;
      q.cols = d_;
      q.codes = pg.codes;
      q.scales = pg.scales;
      src = dequantize(q);
    } else {
      src = pg.kept;
    }
    pg.format = policy_.low;
    pg.codes.assign(size_t(heads_ * T * code_bytes(pg.format, d_)), 0);
    pg.scales.assign(size_t(heads_ * T * (d_ / 32)), 0);
    for (int64_t h = 0; h < heads_; ++h) encode_rows(pg, h, 0, rows, src.data() + h * T * d_);
    pg.kept.clear();
    pg.kept.shrink_to_fit();
    ++pg.version;
  }
}

// pv = mxfp8 / mxfp4: tokens off..off+take-1 of page pg arrive (v: [heads][n][d], rows of this chunk first);
// every 32-key block they touch is quantized again per channel from its originals (the open block's
// earlier tokens from s.v_tail), zero-padded past the last token as prefill pads past Nk.
void KVCache::encode_values(Sequence& s, Page& pg, int64_t off, int64_t take, const float* v, int64_t n) const {
  constexpr int64_t kB = 32;
  const int64_t end = off + take;
  if (s.v_tail.empty()) s.v_tail.assign(size_t(heads_ * kB * d_), 0.0f);
  float col[kB];
  uint8_t codes[kB];
  const Format vf = pv_values_format(policy_.pv);
  const Elem ve = format_info(vf).elem;
  const int64_t vb = code_bytes(vf, d_);  // a key's V code bytes
  for (int64_t b = off / kB; b * kB < end; ++b) {
    // The block's originals, [heads][32][d]: the tail holds its tokens before off.
    std::vector<float> blk(size_t(heads_ * kB * d_), 0.0f);
    for (int64_t h = 0; h < heads_; ++h)
      for (int64_t t = b * kB; t < std::min(end, (b + 1) * kB); ++t) {
        const float* src = t < off ? s.v_tail.data() + (h * kB + t % kB) * d_ : v + (h * n + (t - off)) * d_;
        std::copy(src, src + d_, blk.begin() + (h * kB + t % kB) * d_);
      }
    for (int64_t h = 0; h < heads_; ++h)
      for (int64_t c = 0; c < d_; ++c) {
        for (int64_t t = 0; t < kB; ++t) col[t] = blk[size_t((h * kB + t) * d_ + c)];
        const uint8_t sc = quantize_mx_block(col, int(kB), ve, policy_.scale_rule, codes);
        for (int64_t t = 0; t < kB; ++t)
          set_element_code(pg.v8.data() + (h * T + b * kB + t) * vb, c, ve == Elem::e2m1, codes[t]);
        pg.vs[size_t((h * (T / kB) + b) * d_ + c)] = sc;
      }
    s.v_tail = blk;  // the last block touched is the open one (or complete: then it is not read again)
  }
  if (end % kB == 0) s.v_tail.clear();
}

void KVCache::transform_keys(std::vector<float>& k, int64_t n, int64_t pos, std::vector<float>& state) const {
  if (policy_.transforms().empty()) return;
  const int d = int(d_), R = state_rows();
  if (R > 0 && state.empty()) state.assign(size_t(heads_ * R * d), 0.0f);
  if (policy_.rotate)
    for (int64_t r = 0; r < heads_ * n; ++r) rotate_row(k.data() + r * d, d);
  if (policy_.smooth_k) {
    if (pos == 0)  // the first append fixes the mean: row 0 of each head's state
      for (int64_t h = 0; h < heads_; ++h) {
        const std::vector<float> mu = cpu::channel_mean(k.data() + h * n * d, n, d);
        std::copy(mu.begin(), mu.end(), state.begin() + h * R * d);
      }
    for (int64_t h = 0; h < heads_; ++h)
      for (int64_t r = 0; r < n; ++r)
        for (int i = 0; i < d; ++i) k[size_t((h * n + r) * d + i)] -= state[size_t(h * R * d + i)];
  }
  for (float& x : k) x = round_bf16(x);
  const int64_t first = policy_.smooth_k ? 1 : 0;  // the sink rows follow the mean
  for (int64_t t = pos; t < std::min<int64_t>(policy_.sink_keys, pos + n); ++t)
    for (int64_t h = 0; h < heads_; ++h)
      std::copy_n(k.data() + (h * n + t - pos) * d, d, state.begin() + (h * R + first + t) * d);
}

void KVCache::append(int id, const TensorView& k, const TensorView& v) {
  Sequence& s = seq(id);
  for (const TensorView* t : {&k, &v}) {
    if (t->device != Device::cpu) throw Error("KVCache::append: k and v must be CPU tensors");
    if (t->shape[0] != 1 || t->shape[1] != heads_ || t->shape[3] != d_)
      throw Error("KVCache::append: expected [1, " + std::to_string(heads_) + ", n, " + std::to_string(d_) + "]");
  }
  if (k.shape[2] != v.shape[2]) throw Error("KVCache::append: k and v hold different token counts");
  const int64_t n = k.shape[2];
  // Everything is read and checked before the cache changes, so a bad input leaves it as it was.
  std::vector<float> kall(size_t(heads_ * n * d_)), vall(size_t(heads_ * n * d_));
  for (int64_t h = 0; h < heads_; ++h)
    for (int64_t i = 0; i < n; ++i) {
      load_row(k, 0, h, i, kall.data() + (h * n + i) * d_);
      load_row(v, 0, h, i, vall.data() + (h * n + i) * d_);
    }
  for (size_t i = 0; i < kall.size(); ++i)
    if (!std::isfinite(kall[i]) || !std::isfinite(vall[i])) throw Error("KVCache::append: k or v holds a non-finite value");
  if (n == 0) return;
  // The transforms' state lives with the first page (created below for a new sequence).
  std::vector<float> state = s.table.empty() ? std::vector<float>{} : pages_[size_t(s.table[0])].state;
  transform_keys(kall, n, s.length, state);
  for (int64_t t0 = 0; t0 < n;) {
    const int64_t pos = s.length, block = pos / T, off = pos % T, take = std::min(n - t0, T - off);
    if (off == 0) {  // a new page, in the format its block has as the newest one
      int32_t id_page;
      if (!free_pages_.empty()) {
        id_page = free_pages_.back();
        free_pages_.pop_back();
      } else {
        id_page = int32_t(pages_.size());
        pages_.emplace_back();
      }
      Page& pg = pages_[size_t(id_page)];
      pg.format = policy_.is_high(block, block) ? policy_.high : policy_.low;
      pg.codes.assign(size_t(heads_ * T * code_bytes(pg.format, d_)), 0);
      pg.scales.assign(size_t(heads_ * T * (d_ / 32)), 0);
      if (policy_.pv == PV::bf16) {
        pg.v.assign(size_t(heads_ * T * d_), 0);
      } else {
        pg.v8.assign(size_t(heads_ * T * code_bytes(pv_values_format(policy_.pv), d_)), 0);
        pg.vs.assign(size_t(heads_ * (T / 32) * d_), 0);
      }
      // Originals are kept only where a later re-encoding will need them.
      if (pg.format != policy_.low && block >= policy_.sink_tiles) pg.kept.assign(size_t(heads_ * T * d_), 0.0f);
      s.table.push_back(id_page);
    }
    Page& pg = pages_[size_t(s.table[size_t(block)])];
    for (int64_t h = 0; h < heads_; ++h) {
      const float* kr = kall.data() + (h * n + t0) * d_;
      const float* vr = vall.data() + (h * n + t0) * d_;
      if (policy_.pv == PV::bf16)
        for (int64_t i = 0; i < take * d_; ++i) pg.v[size_t((h * T + off) * d_ + i)] = to_bf16(vr[i]).bits;
      encode_rows(pg, h, off, take, kr);
      if (!pg.kept.empty()) std::copy(kr, kr + take * d_, pg.kept.begin() + (h * T + off) * d_);
    }
    if (policy_.pv != PV::bf16) encode_values(s, pg, off, take, vall.data() + t0 * d_, n);
    ++pg.version;
    s.length += take;
    t0 += take;
    settle(s);
  }
  Page& first = pages_[size_t(s.table[0])];
  if (first.state != state) {
    first.state = std::move(state);
    ++first.version;
  }
}

}  // namespace dmattn
