// Split-KV decode over the KV cache on the GPU: a first, correctness-first kernel. The pages a call
// needs are copied to the device per call (FP8 bytes + E8M0 scales for K, bf16 V); one warp runs
// one (sequence, query head, query row, split) over its pages on the CUDA cores with the CPU
// oracle's arithmetic order (scores per 32-block, online softmax per page, bf16 P); a second kernel
// merges the splits by LSE. Not yet: a device-resident cache, GQA-packed CTAs sharing each page
// across the query heads of a KV head, tensor cores. Semantics: include/dmattn/kv_cache.hpp.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda/buffers.hpp"
#include "cuda/quantize.hpp"
#include "dmattn/quantize.hpp"
#include "problem.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int T = kTile;

struct DecodeParams {
  const uint8_t* k8;         // [pages][Hkv][T][d] FP8 bytes
  const uint8_t* ks;         // [pages][Hkv][T][d/32] E8M0
  const uint16_t* v;         // [pages][Hkv][T][d] bf16
  const uint8_t* page_slot;  // [pages] 0 = high format, 1 = low
  const int32_t* table;      // [S][max_pages] device page index
  const int64_t* length;     // [S]
  int max_pages;
  const uint8_t* q8[2];      // [S*Hq*Nq][d] FP8 bytes per slot
  const uint8_t* qs[2];      // [S*Hq*Nq][d/32]
  bool e5m2[2];
  float* part;               // [S*Hq*Nq][splits][d + 2]: acc, m, l
  int* bad;                  // set when a query holds NaN/Inf (its block scale is the NaN code)
  int S, Hq, Hkv, Nq, splits;
  float scale;
};

template <int D>
__global__ void decode_rows(const DecodeParams p) {
  constexpr int NB = D / 32;
  __shared__ float sq[4][2][D], sqs[4][2][NB];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * 4 + warp;  // (row, split)
  const int64_t rows = int64_t(p.S) * p.Hq * p.Nq;
  if (item >= rows * p.splits) return;
  const int64_t row = item / p.splits;
  const int split = int(item % p.splits);
  const int s = int(row / (int64_t(p.Hq) * p.Nq)), h = int(row / p.Nq % p.Hq), r = int(row % p.Nq);
  const int hk = h / (p.Hq / p.Hkv);
  const int64_t L = p.length[s], kend = L - p.Nq + r + 1;
  for (int slot = 0; slot < 2; ++slot) {
    const Elem e = p.e5m2[slot] ? Elem::e5m2 : Elem::e4m3;
    for (int k = lane; k < D; k += 32) sq[warp][slot][k] = decode_elem(e, p.q8[slot][row * D + k]);
    for (int c = lane; c < NB; c += 32) {
      const uint8_t code = p.qs[slot][row * NB + c];
      if (code == kE8M0NaN) atomicOr(p.bad, 1);
      sqs[warp][slot][c] = decode_e8m0(code);
    }
  }
  __syncwarp();
  const int pages = int((L + T - 1) / T);
  const int j0 = int(int64_t(split) * pages / p.splits), j1 = int(int64_t(split + 1) * pages / p.splits);
  float m = -INFINITY, l = 0.0f, acc[D / 32];
#pragma unroll
  for (int i = 0; i < D / 32; ++i) acc[i] = 0.0f;
  for (int j = j0; j < j1 && int64_t(j) * T < kend; ++j) {
    const int pid = p.table[int64_t(s) * p.max_pages + j];
    const int slot = p.page_slot[pid];
    const Elem e = p.e5m2[slot] ? Elem::e5m2 : Elem::e4m3;
    const int nvalid = int(min(int64_t(T), kend - int64_t(j) * T));
    const int64_t base = (int64_t(pid) * p.Hkv + hk) * T;
    float sc[4], pr[4], mt = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // keys lane + 32 i: sum over blocks of (sq * sk) * dot, as the CPU does
      const int key = lane + 32 * i;
      const uint8_t* kr = p.k8 + (base + key) * D;
      float acc_s = 0.0f;
      for (int c = 0; c < NB; ++c) {
        float t = 0.0f;
        for (int k = c * 32; k < c * 32 + 32; ++k) t += sq[warp][slot][k] * decode_elem(e, kr[k]);
        acc_s += (sqs[warp][slot][c] * decode_e8m0(p.ks[(base + key) * NB + c])) * t;
      }
      sc[i] = acc_s * p.scale;
      if (key < nvalid) mt = fmaxf(mt, sc[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
    const float mnew = fmaxf(m, mt), alpha = expf(m - mnew);
    float psum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pr[i] = lane + 32 * i < nvalid ? expf(sc[i] - mnew) : 0.0f;
      psum += pr[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
    l = l * alpha + psum;
    m = mnew;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) acc[c] *= alpha;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      for (int n = 0; n < 32; ++n) {
        const float pn = __shfl_sync(0xffffffffu, pr[i], n);
        if (32 * i + n >= nvalid) continue;  // uniform across the warp
        const float pb = round_bf16(pn);
        const uint16_t* vr = p.v + (base + 32 * i + n) * D;
#pragma unroll
        for (int c = 0; c < D / 32; ++c) acc[c] += pb * to_float(bf16{vr[lane + 32 * c]});
      }
  }
  float* out = p.part + (row * p.splits + split) * (D + 2);
#pragma unroll
  for (int c = 0; c < D / 32; ++c) out[lane + 32 * c] = acc[c];
  if (lane == 0) {
    out[D] = m;
    out[D + 1] = l;
  }
}

// One thread per (row, column): the splits merged by LSE in one pass over their maxima (the CPU
// oracle folds them pairwise; the two agree to fp32 rounding).
template <class TOut>
__global__ void merge_splits(const float* part, int64_t rows, int splits, int d, TOut* out, int64_t osb, int64_t osh,
                             int64_t osn, int Hq, int Nq, float* lse) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * d) return;
  const int64_t row = i / d;
  const int c = int(i % d);
  float M = -INFINITY;
  for (int sp = 0; sp < splits; ++sp) M = fmaxf(M, part[(row * splits + sp) * (d + 2) + d]);
  float o = 0.0f, lsum = 0.0f;
  for (int sp = 0; sp < splits; ++sp) {
    const float* pp = part + (row * splits + sp) * (d + 2);
    if (pp[d] == -INFINITY) continue;
    const float w = expf(pp[d] - M);
    lsum += pp[d + 1] * w;
    o += pp[c] * w;
  }
  const int64_t s = row / (int64_t(Hq) * Nq), h = row / Nq % Hq, r = row % Nq;
  out[s * osb + h * osh + r * osn + c] = from_float<TOut>(o / lsum);
  if (lse && c == 0) lse[row] = M + logf(lsum);
}

}  // namespace

void decode_attention(const KVCache& cache, const std::vector<int>& seqs, const TensorView& q, const TensorView& out,
                      float* lse, float scale, int splits) {
  const int64_t S = int64_t(seqs.size()), Hkv = cache.kv_heads(), d = cache.head_dim();
  const int64_t Hq = q.shape[1], Nq = q.shape[2], nb = d / 32;
  if (d != 64 && d != 128) throw Error("the CUDA decode supports head dims 64 and 128 (got " + std::to_string(d) + ")");
  if (q.stride[3] != 1 || out.stride[3] != 1) throw Error("the CUDA decode needs unit stride on the head dimension");
  const Policy& pol = cache.policy();
  // The pages the call needs, in device order, as FP8 bytes (E4M3, or E5M2 for mxfp8-e5m2: the
  // element values exactly) and E8M0 scales.
  std::vector<int32_t> table;
  int max_pages = 1;
  for (int sq : seqs) max_pages = std::max<int>(max_pages, int(cache.page_table(sq).size()));
  table.assign(size_t(S * max_pages), 0);
  std::vector<uint8_t> k8, ks, slot;
  std::vector<uint16_t> v;
  std::vector<int64_t> length(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) {
    const auto& t = cache.page_table(seqs[size_t(i)]);
    length[size_t(i)] = cache.length(seqs[size_t(i)]);
    for (size_t j = 0; j < t.size(); ++j) {
      const KVCache::Page& pg = cache.page(t[j]);
      const FormatInfo fi = format_info(pg.format);
      const Elem to = pg.format == Format::mxfp8_e5m2 ? Elem::e5m2 : Elem::e4m3;
      const bool packed = fi.elem == Elem::e2m1;
      const int64_t row_bytes = packed ? d / 2 : d;
      table[size_t(i * max_pages) + j] = int32_t(slot.size());
      slot.push_back(pg.format == pol.high ? 0 : 1);
      for (int64_t rr = 0; rr < Hkv * T; ++rr)
        for (int64_t k = 0; k < d; ++k)
          k8.push_back(encode_elem(to, decode_elem(fi.elem, element_code(pg.codes.data() + rr * row_bytes, k, packed))));
      ks.insert(ks.end(), pg.scales.begin(), pg.scales.end());
      v.insert(v.end(), pg.v.begin(), pg.v.end());
    }
  }
  Buffers buf;  // default stream
  DecodeParams p{};
  p.k8 = buf.upload(k8.data(), k8.size());
  p.ks = buf.upload(ks.data(), ks.size());
  p.v = buf.upload(v.data(), v.size());
  p.page_slot = buf.upload(slot.data(), slot.size());
  p.table = buf.upload(table.data(), table.size());
  p.length = buf.upload(length.data(), length.size());
  p.max_pages = max_pages;
  const int64_t rows = S * Hq * Nq;
  const Format fmt[2] = {pol.high, pol.low};
  QuantTarget qt[2];
  for (int s = 0; s < 2; ++s) {
    qt[s] = QuantTarget{fmt[s], buf.alloc<uint8_t>(size_t(rows * d)), buf.alloc<uint8_t>(size_t(rows * nb)), true};
    p.q8[s] = qt[s].codes;
    p.qs[s] = qt[s].scales;
    p.e5m2[s] = mma_elem(fmt[s]) == Elem::e5m2;
  }
  quantize_rows(q, pol.scale_rule, qt[0], qt[1], nullptr);  // one read of q for both formats
  p.part = buf.alloc<float>(size_t(rows * splits * (d + 2)) * sizeof(float));
  const int zero = 0;
  p.bad = buf.upload(&zero, 1);
  p.S = int(S);
  p.Hq = int(Hq);
  p.Hkv = int(Hkv);
  p.Nq = int(Nq);
  p.splits = splits;
  p.scale = scale;
  const unsigned blocks = unsigned((rows * splits + 3) / 4);
  if (d == 64)
    decode_rows<64><<<blocks, 128>>>(p);
  else
    decode_rows<128><<<blocks, 128>>>(p);
  check(cudaGetLastError(), "decode kernel");
  const unsigned mblocks = unsigned((rows * d + 255) / 256);
  with_typed(out, [&](auto* typed) {
    merge_splits<<<mblocks, 256>>>(p.part, rows, splits, int(d), typed, out.stride[0], out.stride[1], out.stride[2],
                                   int(Hq), int(Nq), lse);
  });
  check(cudaGetLastError(), "merge kernel");
  int bad = 0;
  check(cudaMemcpy(&bad, p.bad, sizeof bad, cudaMemcpyDeviceToHost), "decode");
  if (bad) throw Error("decode_attention: q holds a non-finite value");
}

}  // namespace dmattn::cuda
