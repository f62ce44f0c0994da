#include "cuda/prefill/packing.hpp"

#include <algorithm>
#include <cstring>

#include "dmattn/hd.hpp"
#include "dmattn/policy.hpp"

namespace dmattn::cuda {

Packing::Packing(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k, const Mask& mask) {
  nseq = int(cu_q.size()) - 1;
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  std::vector<SeqSpan> spans(static_cast<size_t>(nseq));
  int32_t tiles = 0;
  for (int i = 0; i < nseq; ++i) {
    const int32_t nk = cu_k[i + 1] - cu_k[i];
    spans[i] = {cu_q[i], cu_q[i + 1] - cu_q[i], cu_k[i], nk, tiles};
    tiles += int32_t((nk + kTile - 1) / kTile);
  }
  ldv = int64_t(tiles) * kTile;
  // Each sequence's query blocks (as query_tiles: positions from its key 0, bottom-right), with the
  // key tiles each visits (Mask::key_tiles, as the kernel), longest first across the sequences.
  struct Job {
    SeqBlock w;
    int64_t cost;
  };
  std::vector<Job> jobs;
  for (int i = 0; i < nseq; ++i) {
    const SeqSpan& s = spans[i];
    if (s.nq == 0) continue;
    Mask m = mask;
    m.nk = s.nk;
    const int64_t pos0 = s.nk - s.nq, first = hd::floor_div(pos0, kTile), last = hd::floor_div(pos0 + s.nq - 1, kTile);
    for (int64_t b = first; b <= last; ++b) {
      const Mask::Tiles t = m.key_tiles(b * kTile, kTile, kTile);
      jobs.push_back({{int32_t(i), int32_t(b)}, t.end - t.begin});
    }
  }
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.cost > b.cost; });
  works = int64_t(jobs.size());

  constexpr size_t kSpanWords = sizeof(SeqSpan) / 4, kBlockWords = sizeof(SeqBlock) / 4;
  seqs = 0;
  work = seqs + size_t(nseq) * kSpanWords;
  key_slot = work + size_t(works) * kBlockWords;
  key_seq = key_slot + size_t(total_k);
  slot_key = key_seq + size_t(total_k);
  query_seq = slot_key + size_t(ldv);
  words.assign(query_seq + size_t(total_q), 0);
  for (int i = 0; i < nseq; ++i) {
    const SeqSpan& s = spans[i];
    std::memcpy(&words[seqs + size_t(i) * kSpanWords], &s, sizeof(SeqSpan));
    for (int32_t j = 0; j < s.nk; ++j) {
      words[key_slot + size_t(s.k0 + j)] = s.tile0 * kTile + j;
      words[key_seq + size_t(s.k0 + j)] = i;
    }
    const int64_t pad_end = int64_t(s.tile0) * kTile + (s.nk + kTile - 1) / kTile * kTile;
    for (int64_t slot = int64_t(s.tile0) * kTile; slot < pad_end; ++slot) {
      const int64_t j = slot - int64_t(s.tile0) * kTile;
      words[slot_key + size_t(slot)] = j < s.nk ? int32_t(s.k0 + j) : -1;
    }
    std::fill_n(&words[query_seq + size_t(s.q0)], s.nq, i);
  }
  for (int64_t n = 0; n < works; ++n) {
    words[work + size_t(n) * kBlockWords] = jobs[size_t(n)].w.seq;
    words[work + size_t(n) * kBlockWords + 1] = jobs[size_t(n)].w.block;
  }
}

PackedMaps Packing::on(const int32_t* base) const {
  PackedMaps m;
  m.seqs = reinterpret_cast<const SeqSpan*>(base + seqs);
  m.nseq = nseq;
  m.work = reinterpret_cast<const SeqBlock*>(base + work);
  m.works = works;
  m.key_slot = base + key_slot;
  m.key_seq = base + key_seq;
  m.slot_key = base + slot_key;
  m.query_seq = base + query_seq;
  m.ldv = ldv;
  return m;
}

}  // namespace dmattn::cuda
