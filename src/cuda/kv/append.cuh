// The device KV cache's writers: new tokens quantized on the GPU straight into the page records the
// decode kernel reads (kv_record.hpp), with the host KVCache's codes bit for bit. One warp a run of K
// rows (each row's 32-blocks groups of its lanes), one warp a V column block (pv MX, a lane a channel).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/rotate_lanes.cuh"
#include "cuda/common/with_elem.cuh"
#include "cuda/decode/kv_record.hpp"
#include "cuda/kv/row_runs.hpp"
#include "cuda/ptx/fp8.cuh"
#include "cuda/ptx/e2m1_bytes.hpp"
#include "cuda/ptx/pdl.cuh"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda::kv {

constexpr int kPage = 128;  // tokens a page (one key tile)

// The device cache's arrays (one pool each; PagedKVCache::Impl owns them).
struct Pools {
  uint8_t* rec = nullptr;      // [pages][Hkv][4][record]
  uint8_t* slot = nullptr;     // [pages] K's format: 0 = the policy's high, 1 = low (the decode reads it)
  int32_t* kept_of = nullptr;  // [pages] the kept slot of a page whose original keys are kept, else -1
  uint8_t* pending = nullptr;  // [pages] 1: re-encoded from its kept keys after this append's rows land
  float* kept = nullptr;       // [kept slots][Hkv][128][d] original keys of window pages
  float* vtail = nullptr;      // [sequences][2][Hkv][32][d] originals of the open V block (pv MX), two buffers
  int32_t* table = nullptr;    // [sequences][cols] physical page of each logical page
  int32_t* length = nullptr;   // [sequences] tokens
  float* state = nullptr;      // [pages][Hkv][srows][d] the transforms' key state, at each sequence's first page:
                               // smooth_k's mean (the first append's), then the sink keys' rows
  int cols = 0, Hkv = 0, d = 0, vbits = 16;
  int64_t record = 0;          // bytes of one record
  bool transformed = false;    // any transform on: keys enter quantization as bf16 values
  bool rotate = false, smooth_k = false;  // the policy's key transforms (KVCache::transform_keys)
  int sink_keys = 0, srows = 0;
  // [3]: the epoch of the last prepared plan carried out; 1 while the latest replay found its plan
  // already carried out (or not the one it was captured for): decode then reads no keys; and the count
  // of apply_plan's CTAs done with a prepared plan (open_plan).
  int32_t* gate = nullptr;
};

// An append's work, as the host planned it (int32 arrays, device copies):
//  batch [S][3]: sequence id, its length before the append, which V tail buffer holds its open block;
//  table [nt][2]: flat index into Pools::table, page; meta [nm][4]: page, slot, kept slot, pending;
//  zero [nz]: new pages, their records and state zeroed first (-1 - page: a page the append fills, every
//  record byte of which its writers write: its state alone); reenc [nr][3]: page, kept slot, rows.
// A prepared plan (PagedKVCache::prepare, what a CUDA graph replays) lives at fixed addresses and
// its counts in device memory, `head` [kHead]: its epoch, S, n, nt, nm, nz, nr; the launches are
// sized for its capacity, and each kernel takes the counts from there (resolve). A plan's kernels
// run as a chain of programmatic dependents (follow_prior_grids first).
constexpr int kHead = 7;
struct Plan {
  const int32_t *batch, *table, *meta, *zero, *reenc;
  int S, n, nt, nm, nz, nr;
  const int32_t* head = nullptr;
};

// A prepared plan's counts, read from device memory.
__device__ __forceinline__ void read_counts(Plan& plan) {
  plan.nt = plan.head[3];
  plan.nm = plan.head[4];
  plan.nz = plan.head[5];
  plan.nr = plan.head[6];
}

// A kernel's view of its plan after apply_plan: a prepared plan's counts read from device memory;
// false where the replay carries out nothing (open_plan found it stale).
__device__ __forceinline__ bool resolve(Plan& plan, const int32_t* gate) {
  if (!plan.head) return true;
  if (gate[1]) return false;
  read_counts(plan);
  return true;
}

// A prepared plan is carried out only where its epoch follows the last one carried out and it was
// prepared for the launches' S and n (the captured ones); else the replay is stale, the plan's kernels
// do nothing and the decode reads no keys (its rows come out NaN). apply_plan, the plan's first
// kernel, decides it in each CTA; the last of its CTAs to finish, once every CTA has read the gate,
// records the outcome for the kernels after it. Every CTA of the launch calls it, at its end.
__device__ __forceinline__ void open_plan(const Plan& plan, int32_t* gate, bool next) {
  __syncthreads();  // every thread of this CTA has read the gate
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(gate + 2, 1) != int(gridDim.x) - 1) return;
  gate[2] = 0;
  gate[1] = !next;
  if (next) gate[0] = plan.head[0];
}
__device__ __forceinline__ bool plan_is_next(const Plan& plan, const int32_t* gate) {
  return !plan.head || (plan.head[0] == gate[0] + 1 && plan.head[1] == plan.S && plan.head[2] == plan.n);
}

// The global index of the calling thread's warp (a warp an item in the writers below).
__device__ __forceinline__ int64_t warp_index() { return (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; }

// The appended tokens: k and v [S][Hkv][n][d] with these element strides (unit on d); vec: both
// take load_lane's vector path (vector_rows).
template <class T>
struct NewTokens {
  const T *k, *v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  bool vec;
};

// The element types an append writes: K in the policy's high and low formats, V's (pv MX: E4M3 or
// E2M1, pv_values_format's).
struct Codes {
  Elem high, low, v;
  ScaleRule rule;
};

__device__ __forceinline__ uint8_t* record_at(const Pools& p, int32_t page, int h, int key) {
  return p.rec + ((int64_t(page) * p.Hkv + h) * (kPage / kRecordKeys) + key / kRecordKeys) * p.record;
}

// One value already divided by its block's scale, as the codec's encode_elem encodes it, bit for bit:
// FP8 the same hardware conversion, E2M1 its comparison-free twin
// (MxCodec.FastE2M1EqualsTheCodecOnEveryFloat), FP6 the codec itself.
template <Elem kE>
__device__ __forceinline__ uint8_t encode_code(float y) {
  if constexpr (kE == Elem::e2m1) return encode_e2m1_fast(y);
  else if constexpr (kE == Elem::e4m3) return fp8_encode<false>(y);
  else if constexpr (kE == Elem::e5m2) return fp8_encode<true>(y);
  else return encode_elem(elem_spec(kE), y);
}

// A lane's E codes (E consecutive elements of one 32-block, already divided by the block's scale),
// packed as a record holds them: FP8 and FP6 one byte an element, E2M1 two a byte (the even element in
// the low nibble). FP8 pairs take one conversion; every other element is encode_code's, without its NaN
// test for E2M1 (the block's values are finite: a NaN or Inf gives the block the NaN scale and no codes).
template <int E, Elem kE>
__device__ __forceinline__ uint64_t encode_lane_codes(const float (&y)[E]) {
  uint64_t w = 0;
  if constexpr (kE == Elem::e4m3 || kE == Elem::e5m2) {
#pragma unroll
    for (int i = 0; i < E; i += 2) w |= uint64_t(fp8x2_encode<kE == Elem::e5m2>(y[i], y[i + 1])) << (8 * i);
  } else {
    constexpr int bits = kE == Elem::e2m1 ? 4 : 8;
#pragma unroll
    for (int i = 0; i < E; ++i)
      w |= uint64_t(kE == Elem::e2m1 ? encode_e2m1_not_nan(y[i]) : encode_code<kE>(y[i])) << (bits * i);
  }
  return w;
}

// The low N bytes of w, stored at an N-byte aligned address (N = 1, 2, 4 or 8).
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* dst, uint64_t w) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "a store of up to the 8 bytes of w");
  if constexpr (N == 8)
    *reinterpret_cast<uint2*>(dst) = make_uint2(uint32_t(w), uint32_t(w >> 32));
  else if constexpr (N == 4)
    *reinterpret_cast<uint32_t*>(dst) = uint32_t(w);
  else if constexpr (N == 2)
    *reinterpret_cast<uint16_t*>(dst) = uint16_t(w);
  else
    *dst = uint8_t(w);
}

// The largest magnitude among x, and (bad) whether any of them is NaN or infinite: what a block's
// scale is chosen from. In integer compares of the magnitudes' bits, which order non-negative floats
// as their values and put Inf and NaN above every finite one (the magnitude is used only where none is).
template <int N>
__device__ __forceinline__ float values_amax(const float (&x)[N], bool& bad) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) m = max(m, hd::bits_of(x[i]) & 0x7FFFFFFFu);
  bad = m >= 0x7F800000u;
  return hd::float_of(m);
}

// Key row `key` (0..127 in its page), held by the warp as rotate_lanes holds a row (lane l: channels
// E l .. E l + E - 1, E = D / 32), written in format e (the page's) into the K codes and scales of its
// record r (record_at) with quantize_mx_block's bytes: each 32-block is 32 / E consecutive lanes, which
// combine their amax and NaN/Inf flags (shuffles within the block), take the block's scale and divide
// by it (a product by a power of two: the codec's ldexp, one rounding), and store their E codes at once.
template <int D, Elem e>
__device__ __forceinline__ void write_key_row(uint8_t* r, int key, const float (&x)[D / 32], ScaleRule rule) {
  constexpr int E = D / 32, L = 32 / E;  // channels a lane, lanes a block
  const int lane = threadIdx.x % 32, k = key % kRecordKeys;
  bool bad;
  float amax = values_amax(x, bad);
#pragma unroll
  for (int s = 1; s < L; s *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
  const uint32_t block_lanes = (L == 32 ? 0xffffffffu : (1u << L) - 1u) << (lane & ~(L - 1));
  bad = (__ballot_sync(0xffffffffu, bad) & block_lanes) != 0;
  const uint8_t sc = bad ? kE8M0NaN : choose_e8m0_nonneg(amax, e, rule);  // amax finite
  float y[E];
  const float inv = inverse_e8m0(sc);
#pragma unroll
  for (int i = 0; i < E; ++i) y[i] = x[i] * inv;
  const uint64_t w = sc == kE8M0NaN ? 0 : encode_lane_codes<E, e>(y);  // the NaN scale carries the block
  if constexpr (e == Elem::e2m1) {
    constexpr int row = record_k_row(D, true);
    store_bytes<E / 2>(r + record_k(D, true) + k * row + swizzled(row / 16, k, E / 2 * lane), w);
    store_bytes<E / 2>(r + k * (D / 2) + E / 2 * lane, 0);  // the K region's unused head: the row's share of it
  } else {
    constexpr int row = record_k_row(D, false);
    store_bytes<E>(r + record_k(D, false) + k * row + swizzled(row / 16, k, E * lane), w);
  }
  if (lane % L == 0) r[record_k_scales(D) + k * (D / 32) + lane / L] = sc;
}

// A batch entry of an append: the sequence, its length before the append, which V tail buffer holds
// its open block (Plan::batch's three ints).
struct Entry {
  int seq, pos0, buf;
};
template <class Batch>  // a Plan's device array, or a step launch's parameter array
__device__ __forceinline__ Entry entry_of(const Batch& batch, int i) {
  return Entry{batch[3 * i], batch[3 * i + 1], batch[3 * i + 2]};
}

// New tokens t0 .. t1 - 1 of head h of batch entry i (e): each K row (and bf16 V row) by the warp, lane l
// holding channels E l .. E l + E - 1.
template <int D, class T>
__device__ __forceinline__ void append_rows(const Pools& p, const NewTokens<T>& x, const Codes& cd, int i, int h, int t0,
                                            int t1, Entry e) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x % 32;
  const int seq = e.seq;
  const T* kbase = x.k + i * x.ks0 + h * x.ks1 + E * lane;
  const T* vbase = x.v + i * x.vs0 + h * x.vs1 + E * lane;
  auto load = [&](const T* base, int64_t stride, int t, float (&r)[E]) { load_lane<E>(base + t * stride, x.vec, r); };
  float kn[E], vn[E] = {};  // the first row's loads go first: the mean's wait on two dependent loads
  load(kbase, x.ks2, t0, kn);
  if (p.vbits == 16) load(vbase, x.vs2, t0, vn);
  // This head's state at the sequence's first page (none without smooth_k or sink keys), and its mean.
  float* st = p.transformed && p.srows > 0 ? p.state + (int64_t(p.table[int64_t(seq) * p.cols]) * p.Hkv + h) * p.srows * D : nullptr;
  float mean[E] = {};
  if (p.transformed && p.smooth_k)
#pragma unroll
    for (int c = 0; c < E; ++c) mean[c] = st[E * lane + c];
  int32_t page = 0, ks = -1;
  bool pending = false, low = false;
  uint8_t* page_rec = nullptr;  // the page's first record of head h
  for (int t = t0; t < t1; ++t) {
    const int pos = e.pos0 + t, key = pos % kPage;
    float r[E], v[E];
#pragma unroll
    for (int c = 0; c < E; ++c) {
      r[c] = kn[c];
      v[c] = vn[c];
    }
    if (t + 1 < t1) {  // the next row's load, in flight during this one
      load(kbase, x.ks2, t + 1, kn);
      if (p.vbits == 16) load(vbase, x.vs2, t + 1, vn);
    }
    if (t == t0 || key == 0) {  // the row's page and its bookkeeping
      page = p.table[int64_t(seq) * p.cols + pos / kPage];
      ks = p.kept_of[page];
      pending = p.pending[page];
      low = p.slot[page];
      page_rec = record_at(p, page, h, 0);
    }
    uint8_t* rec = page_rec + (key / kRecordKeys) * p.record;  // the row's record
    if (p.transformed) {
      // The transforms as the host cache runs them: rotated, smooth_k's mean subtracted, rounded to
      // bf16; the sink keys' rows into the state.
      if (p.rotate) rotate_lanes<E>(r);
      static_assert(E % 2 == 0, "the rounding takes channel pairs");
#pragma unroll
      for (int c = 0; c < E; c += 2) {
        r[c] -= mean[c];
        r[c + 1] -= mean[c + 1];
        round_bf16x2(r[c], r[c + 1]);
      }
      if (pos < p.sink_keys)
#pragma unroll
        for (int c = 0; c < E; ++c) st[(int(p.smooth_k) + pos) * D + E * lane + c] = r[c];
    }
    if (ks >= 0) {
      float* kept = p.kept + ((int64_t(ks) * p.Hkv + h) * kPage + key) * D + E * lane;
#pragma unroll
      for (int c = 0; c < E; ++c) kept[c] = r[c];
    }
    if (!pending)
      with_elem(low ? cd.low : cd.high, [&](auto e) { write_key_row<D, decltype(e)::value>(rec, key, r, cd.rule); });
    if (p.vbits == 16) {  // V's bf16 row: the lane's E channels, one store within a swizzled 16-byte chunk
      uint32_t w[E / 2];
#pragma unroll
      for (int c = 0; c < E; c += 2) w[c / 2] = uint32_t(to_bf16(v[c]).bits) | uint32_t(to_bf16(v[c + 1]).bits) << 16;
      uint8_t* dst = rec + record_v(D) + (key % kRecordKeys) * 2 * D + swizzled(2 * D / 16, key % kRecordKeys, 2 * E * lane);
      if constexpr (E == 8)  // (d = 256: the lane's 16 bytes are one whole chunk)
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      else if constexpr (E == 4)
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
      else
        *reinterpret_cast<uint32_t*>(dst) = w[0];
    }
  }
}

// Which tail buffer holds a sequence's open V block after an append of keys pos0 .. end - 1 to it,
// buf before. An append within one 32-key block adds its keys in place (a lane owns its channel, the
// earlier keys stay); one that spans blocks starts the last block in the other buffer, which the
// first block's warp, still reading the earlier keys, does not touch.
__host__ __device__ inline int next_tail(int buf, int64_t pos0, int64_t end) {
  return end % kRecordKeys != 0 && pos0 / kRecordKeys != (end - 1) / kRecordKeys ? 1 - buf : buf;
}

// One channel's whole V block (32 values, all new: a prompt's full blocks), encoded in element format
// kE and written as the record's column holds it (kv_record.hpp) at once: E2M1 one 16-byte store, FP8
// and FP6 two (FP8 pairs in one conversion; a pair of keys 2i, 2i + 1 is adjacent in vt_position's
// order). A store a key would make each store instruction of the warp touch 32 sectors for one byte of
// each. Columns are 16-byte aligned: every record region's size is a multiple of 16.
template <Elem kE>
__device__ __forceinline__ void write_value_column(uint8_t* dst, uint8_t* scale, const float (&x)[kRecordKeys],
                                                   ScaleRule rule) {
  bool bad;
  const float amax = values_amax(x, bad);
  const uint8_t sc = bad ? kE8M0NaN : choose_e8m0_nonneg(amax, kE, rule);  // amax finite
  const float inv = inverse_e8m0(sc);  // a product by a power of two: the codec's ldexp
  uint32_t w[8] = {};                  // the column's 16 (E2M1) or 32 bytes; zero codes under a NaN scale
  if (sc != kE8M0NaN) {
    if constexpr (kE == Elem::e2m1) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        uint8_t codes[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) codes[j] = encode_e2m1_not_nan(x[8 * (j / 2) + 2 * t + j % 2] * inv);
        w[t] = e2m1x8_f16_pack(codes);
      }
    } else if constexpr (kE == Elem::e4m3 || kE == Elem::e5m2) {
#pragma unroll
      for (int j = 0; j < kRecordKeys; j += 2)
        w[vt_position(j) / 4] |= uint32_t(fp8x2_encode<kE == Elem::e5m2>(x[j] * inv, x[j + 1] * inv))
                                 << 8 * (vt_position(j) % 4);
    } else {
#pragma unroll
      for (int j = 0; j < kRecordKeys; ++j)
        w[vt_position(j) / 4] |= uint32_t(encode_code<kE>(x[j] * inv)) << 8 * (vt_position(j) % 4);
    }
  }
  uint4* out = reinterpret_cast<uint4*>(dst);
  out[0] = make_uint4(w[0], w[1], w[2], w[3]);
  if constexpr (kE != Elem::e2m1) out[1] = make_uint4(w[4], w[5], w[6], w[7]);
  *scale = sc;
}

// pv MX: each warp 32 channels of one 32-key V block an append touches, a lane a channel (so every
// load and store of a key's row is coalesced), the block's codes and scale written transposed
// (kv_record.hpp); the last block's originals, if it is still open, go to the tail buffer next_tail
// names. The scale is monotone in the block's amax, so the block's new scale is the larger of its
// stored one and the new values' own: where that leaves it unchanged (a decode step, mostly) only
// the new keys' codes are written; else the block is quantized again from its originals (earlier
// tokens from the sequence's tail buffer, zeros past the last token). Warp w is (batch entry, head,
// block, channel group): block bi from the entry's first and channels 32 cg .. 32 cg + 31 of head h
// of entry i (e), n tokens appended. V's format is a type here: a warp's path through the block is
// one format's code, straight (a decode step's warps run it once, from a cold instruction cache).
template <int D, Elem ve, class T>
__device__ __forceinline__ void append_value_block(const Pools& p, const NewTokens<T>& nt, ScaleRule rule, int n, int i,
                                                   int h, int bi, int cg, Entry e) {
  static_assert(record_v(D) % 16 == 0 && record_bytes(D, 4) % 16 == 0 && record_bytes(D, 8) % 16 == 0,
                "store_column's 16-byte stores need 16-byte aligned columns");
  const int lane = threadIdx.x % 32, c = 32 * cg + lane;
  const int seq = e.seq, pos0 = e.pos0, buf = e.buf;
  const int end = pos0 + n, b = pos0 / kRecordKeys + bi, k0 = b * kRecordKeys;
  if (k0 >= end) return;  // this sequence touches fewer blocks (uniform across the warp)
  const int from = max(pos0, k0) - k0, to = min(end - k0, kRecordKeys);  // the new keys' slots in the block
  const int32_t page = p.table[int64_t(seq) * p.cols + k0 / kPage];
  uint8_t* col = record_at(p, page, h, k0 % kPage) + record_v(D);
  const int vt_row = record_vt_row(p.vbits);
  const int64_t tail = (int64_t(seq) * 2 * p.Hkv + h) * kRecordKeys * D + c;  // buffer 0 of (seq, h), column c
  const int64_t other = int64_t(p.Hkv) * kRecordKeys * D;                    // buffer 1 - 0
  // The open block's new originals go to the tail buffer for the next append.
  float* keep = end % kRecordKeys != 0 && b == (end - 1) / kRecordKeys ? p.vtail + tail + next_tail(buf, pos0, end) * other
                                                                       : nullptr;
  uint32_t* words = reinterpret_cast<uint32_t*>(col + c * vt_row);  // E2M1: word t holds keys 8j + 2t (+1), j = 0..3
  // Key `key`'s code into the column: E2M1 codes packed for f16 (kv_record.hpp), cleared around it
  // where the block starts here; FP8 bytes at vt_position.
  auto write_one = [&](int key, uint8_t code) {
    if constexpr (ve == Elem::e2m1) {
      const int t = key % 8 / 2, at = 2 * (key / 8) + key % 2;
      uint8_t codes[8], ones[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        codes[j] = j == at ? code : uint8_t(0);
        ones[j] = j == at ? uint8_t(0xF) : uint8_t(0);
      }
      words[t] = (key > 0 ? words[t] & ~e2m1x8_f16_pack(ones) : 0u) | e2m1x8_f16_pack(codes);
    } else {
      col[c * vt_row + vt_position(key)] = code;
    }
  };
  if (from == 0 && to == kRecordKeys) {  // a whole block: no stored codes to keep, no open block
    float x[kRecordKeys];
    const T* src = nt.v + i * nt.vs0 + h * nt.vs1 + (k0 - pos0) * nt.vs2 + c;
#pragma unroll
    for (int j = 0; j < kRecordKeys; ++j) x[j] = to_float(src[j * nt.vs2]);
    return write_value_column<ve>(col + c * vt_row, col + D * vt_row + c, x, rule);
  }
  const uint8_t old = from > 0 ? col[D * vt_row + c] : uint8_t(0);  // the block's stored scale
  // The new keys' values (zeros elsewhere) and the block's new scale: the larger of its stored one
  // and theirs (NaN, 0xFF, is the largest code).
  float x[kRecordKeys];
  uint8_t sc;
  if (to - from == 1) {  // one new key (a decode step): its code alone, unless it raises the block's scale
    const float y = to_float(nt.v[i * nt.vs0 + h * nt.vs1 + (k0 + from - pos0) * nt.vs2 + c]);
    sc = max(hd::is_finite(y) ? choose_e8m0(hd::abs_f(y), ve, rule) : kE8M0NaN, old);
    if (from == 0 || sc == old) {
      write_one(from, sc == kE8M0NaN ? uint8_t(0) : encode_code<ve>(y * inverse_e8m0(sc)));
      col[D * vt_row + c] = sc;
      if (keep) keep[from * D] = y;
      return;
    }
#pragma unroll
    for (int j = 0; j < kRecordKeys; ++j) x[j] = j == from ? y : 0.0f;
  } else {
    float amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < kRecordKeys; ++j) {
      x[j] = j >= from && j < to ? to_float(nt.v[i * nt.vs0 + h * nt.vs1 + (k0 + j - pos0) * nt.vs2 + c]) : 0.0f;
      bad |= !hd::is_finite(x[j]);
      amax = fmaxf(amax, hd::abs_f(x[j]));
    }
    sc = max(bad ? kE8M0NaN : choose_e8m0(amax, ve, rule), old);
  }
  const float inv = inverse_e8m0(sc);  // a product by a power of two: the codec's ldexp
  auto code_of = [&](float y) { return sc == kE8M0NaN ? uint8_t(0) : encode_code<ve>(y * inv); };
  const bool whole = from > 0 && sc != old;  // the earlier keys' codes change with the scale
  if (whole)
#pragma unroll
    for (int j = 0; j < kRecordKeys; ++j)
      if (j < from) x[j] = p.vtail[tail + buf * other + j * D];
  const int lo = whole ? 0 : from;  // the keys whose codes are written
  if constexpr (ve == Elem::e2m1) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      uint8_t ones[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int key = 8 * (j / 2) + 2 * t + j % 2;
        ones[j] = key >= lo && key < to ? uint8_t(0xF) : uint8_t(0);
      }
      const uint32_t mask = e2m1x8_f16_pack(ones);
      if (mask) {
        uint8_t codes[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) codes[j] = ones[j] ? code_of(x[8 * (j / 2) + 2 * t + j % 2]) : uint8_t(0);
        words[t] = (lo > 0 ? words[t] & ~mask : 0u) | e2m1x8_f16_pack(codes);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kRecordKeys; ++j)
      if (j >= lo && j < to) col[c * vt_row + vt_position(j)] = code_of(x[j]);
  }
  col[D * vt_row + c] = sc;
  if (keep)
#pragma unroll
    for (int j = 0; j < kRecordKeys; ++j)
      if (j >= from && j < to) keep[j * D] = x[j];
}

// The V block warps of an append to S sequences touching at most `blocks` V blocks each (pv MX; bf16 V
// rows go with the K rows), and warp v of them: (batch entry, head, block, channel group), orders of
// significance as listed, reversed; `batch` as Plan::batch.
__host__ __device__ inline int64_t value_warps(const Pools& p, int64_t S, int blocks) {
  return p.vbits == 16 ? 0 : S * p.Hkv * blocks * (p.d / 32);
}
template <int D, class T>
__device__ __forceinline__ void append_value_item(const Pools& p, const NewTokens<T>& x, const Codes& cd, int n,
                                                  int blocks, const int32_t* batch, int64_t v) {
  constexpr int CG = D / 32;
  const int cg = int(v % CG), bi = int(v / CG % blocks), h = int(v / CG / blocks % p.Hkv), i = int(v / CG / blocks / p.Hkv);
  if (cd.v == Elem::e2m1)
    append_value_block<D, Elem::e2m1>(p, x, cd.rule, n, i, h, bi, cg, entry_of(batch, i));
  else
    append_value_block<D, Elem::e4m3>(p, x, cd.rule, n, i, h, bi, cg, entry_of(batch, i));
}

// smooth_k: a sequence's first append fixes its keys' mean (KVCache::transform_keys): per channel
// the mean of the rotated rows, summed in fp64. Partial sums of kMeanRows-row chunks, a warp a
// (batch entry, head, chunk), lanes holding rotate_lanes' channels; only entries starting at 0.
// kValues: the append's V blocks (pv MX) take the warps after them, as they need no mean: their loads
// and encoding run beside the mean's rotations, which the shuffles bound (its own instance: the V
// blocks' registers, held to 80 as append_items', would halve the mean's warps where it runs alone).
constexpr int kMeanRows = 256;
template <int D, class T, bool kValues>
__global__ void __launch_bounds__(256, 3) key_mean_parts(Pools p, Plan plan, NewTokens<T> x, int chunks, double* part,
                                                         Codes cd, int blocks) {
  constexpr int E = D / 32;
  follow_prior_grids();
  if (!resolve(plan, p.gate)) return;
  const int64_t w = warp_index(), means = int64_t(plan.S) * p.Hkv * chunks;
  if (w >= means) {
    if (kValues && w - means < value_warps(p, plan.S, blocks))
      append_value_item<D>(p, x, cd, plan.n, blocks, plan.batch, w - means);
    return;
  }
  const int ch = int(w % chunks), h = int(w / chunks % p.Hkv), i = int(w / chunks / p.Hkv), lane = threadIdx.x % 32;
  if (plan.batch[3 * i + 1] != 0) return;
  double acc[E] = {};
  const T* base = x.k + i * x.ks0 + h * x.ks1 + E * lane;
  const int t0 = ch * kMeanRows, t1 = min(plan.n, (ch + 1) * kMeanRows);
  float next[E];  // the next row, loaded while this one is rotated and summed
  load_lane<E>(base + t0 * x.ks2, x.vec, next);
  for (int t = t0; t < t1; ++t) {
    float r[E];
#pragma unroll
    for (int e = 0; e < E; ++e) r[e] = next[e];
    if (t + 1 < t1) load_lane<E>(base + (t + 1) * x.ks2, x.vec, next);
    if (p.rotate) rotate_lanes<E>(r);
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] += r[e];
  }
#pragma unroll
  for (int e = 0; e < E; ++e) part[w * D + E * lane + e] = acc[e];
}
// The chunks' sums in order, / n, into row 0 of the state at the sequence's first page (a thread a
// channel of a (batch entry, head)).
template <int D>
__global__ void key_mean_finish(Pools p, Plan plan, int chunks, const double* part) {
  follow_prior_grids();
  if (!resolve(plan, p.gate)) return;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid >= int64_t(plan.S) * p.Hkv * D) return;
  const int c = int(tid % D), h = int(tid / D % p.Hkv), i = int(tid / D / p.Hkv);
  if (plan.batch[3 * i + 1] != 0) return;
  double sum = 0;
#pragma unroll 8
  for (int ch = 0; ch < chunks; ++ch) sum += part[((int64_t(i) * p.Hkv + h) * chunks + ch) * D + c];  // in order
  const int seq = plan.batch[3 * i];
  p.state[(int64_t(p.table[int64_t(seq) * p.cols]) * p.Hkv + h) * p.srows * D + c] = float(sum / double(plan.n));
}

// An append's items: K rows first, a warp a run of rows (row_runs.hpp: append_rows), then, with
// `values`, V blocks (append_value_item).
__host__ __device__ inline int64_t item_warps(const Pools& p, int64_t S, int64_t n, int blocks, bool values = true) {
  return row_runs(S, p.Hkv, n) + (values ? value_warps(p, S, blocks) : 0);
}
template <int D, class T>
__device__ __forceinline__ void append_item(const Pools& p, const NewTokens<T>& x, const Codes& cd, int S, int n,
                                            int blocks, const int32_t* batch, bool values, int64_t w) {
  const int64_t runs = row_runs(S, p.Hkv, n);
  if (w < runs) {
    const RowRun r = row_run(w, S, p.Hkv, n);
    append_rows<D>(p, x, cd, r.i, r.h, r.t0, r.t1, entry_of(batch, r.i));
  } else if (values && w - runs < value_warps(p, S, blocks)) {
    append_value_item<D>(p, x, cd, n, blocks, batch, w - runs);
  }
}

// Pages that left the window: K re-encoded in the low format from the kept originals. Warp w is
// (entry, head, key), reversed, the launch's warps striding over them (a prepared plan's launch is
// sized for its capacity, most of which a step leaves idle); keys past the page's rows encode zeros
// (codes and scales 0, as a fresh page holds).
template <int D>
__device__ __forceinline__ void reencode_rows(const Pools& p, const Plan& plan, Elem low, ScaleRule rule) {
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t w = warp_index(); w < int64_t(plan.nr) * p.Hkv * kPage; w += warps) {
    const int key = int(w % kPage), h = int(w / kPage % p.Hkv), r = int(w / kPage / p.Hkv);
    const int lane = threadIdx.x % 32;
    const int32_t page = plan.reenc[3 * r], ks = plan.reenc[3 * r + 1], rows = plan.reenc[3 * r + 2];
    constexpr int E = D / 32;
    const float* src = p.kept + ((int64_t(ks) * p.Hkv + h) * kPage + key) * D + E * lane;
    float x[E];
#pragma unroll
    for (int c = 0; c < E; ++c) x[c] = key < rows ? src[c] : 0.0f;
    with_elem(low, [&](auto e) { write_key_row<D, decltype(e)::value>(record_at(p, page, h, key), key, x, rule); });
  }
}
template <int D>
__global__ void reencode_pages(Pools p, Plan plan, Elem low, ScaleRule rule) {
  follow_prior_grids();
  if (!resolve(plan, p.gate)) return;
  reencode_rows<D>(p, plan, low, rule);
}

// The general append's writer (after apply_plan), a warp an item; `values`: the V blocks too, where
// key_mean_parts did not take them. with_reencode: the re-encoding too
// (reencode_rows), where no page it re-encodes takes a new key: an append of one token a sequence, whose
// new key's page is on the diagonal (the pages leaving the window are older).
// Three CTAs an SM: unbounded, the key rows take 88 registers, which leaves two (a quarter of the
// warps), too few to cover their loads' latency; at 80 none spill and a long prompt fills a fifth faster.
template <int D, class T>
__global__ void __launch_bounds__(256, 3) append_items(Pools p, Plan plan, NewTokens<T> x, Codes cd, int blocks, bool values,
                                                       bool with_reencode) {
  follow_prior_grids();
  if (!resolve(plan, p.gate)) return;
  append_item<D>(p, x, cd, plan.S, plan.n, blocks, plan.batch, values, warp_index());
  if (with_reencode) reencode_rows<D>(p, plan, cd.low, cd.rule);
}

// An append that opens no page and re-encodes none (a decode step, 127 times in 128): one launch
// with its batch in the parameters (no upload), the lengths, the K rows and the V blocks together.
constexpr int kStepSeqs = 256;  // batch entries a step launch carries (3 KB of its 4 KB of parameters)
template <class T>
struct StepArgs {
  Pools p;
  NewTokens<T> x;
  Codes cd;
  int S, n, blocks;
  int32_t batch[3 * kStepSeqs];  // as Plan::batch
};
template <int D, class T>
__global__ void append_step(const __grid_constant__ StepArgs<T> a) {
  const Pools p = a.p;  // a copy, read from the parameter bank: its fields stay plain loads
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid < a.S) {  // the lengths (the launch has at least a thread an entry)
    const Entry e = entry_of(a.batch, int(tid));
    p.length[e.seq] = e.pos0 + a.n;
  }
  append_item<D>(p, a.x, a.cd, a.S, a.n, a.blocks, a.batch, true, warp_index());
}

// The plan's table, length and page updates, and zeroed records for new pages (grid-stride).
__device__ __forceinline__ void apply_items(const Pools& p, const Plan& plan, int64_t page_bytes) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < plan.nt; i += stride) p.table[plan.table[2 * i]] = plan.table[2 * i + 1];
  for (int64_t i = tid; i < plan.S; i += stride) p.length[plan.batch[3 * i]] = plan.batch[3 * i + 1] + plan.n;
  for (int64_t i = tid; i < plan.nm; i += stride) {
    const int32_t page = plan.meta[4 * i];
    p.slot[page] = uint8_t(plan.meta[4 * i + 1]);
    p.kept_of[page] = plan.meta[4 * i + 2];
    p.pending[page] = uint8_t(plan.meta[4 * i + 3]);
  }
  // The new pages, a warp a page: records zeroed unless the page's writers fill it (-1 - page), state
  // always (a first page's: zeros, as the host's).
  const int lane = threadIdx.x % 32;
  const int64_t words = page_bytes / 16, sf = int64_t(p.Hkv) * p.srows * p.d / 4;  // 16-byte words
  for (int64_t i = tid / 32; i < plan.nz; i += stride / 32) {
    const int32_t z = plan.zero[i];
    if (z >= 0)
      for (int64_t w = lane; w < words; w += 32)
        reinterpret_cast<uint4*>(p.rec + int64_t(z) * page_bytes)[w] = make_uint4(0, 0, 0, 0);
    for (int64_t w = lane; w < sf; w += 32)
      reinterpret_cast<float4*>(p.state + int64_t(z >= 0 ? z : -1 - z) * sf * 4)[w] = make_float4(0, 0, 0, 0);
  }
}

// The plan's first kernel: apply_items where the plan is carried out (open_plan).
__global__ void apply_plan(Pools p, Plan plan, int64_t page_bytes) {
  follow_prior_grids();
  const bool next = plan_is_next(plan, p.gate);
  if (next) {
    if (plan.head) read_counts(plan);
    apply_items(p, plan, page_bytes);
  }
  if (plan.head) open_plan(plan, p.gate, next);
}

// Rows of the page table and the lengths of the decode's sequences, gathered in call order. The ids
// travel in the parameters where they fit (no upload), else in device memory.
constexpr int kGatherIds = 896;
struct Gather {
  const int32_t *table, *length;
  int cols, S, max_pages;
  int32_t *out_table, *out_length;
  const int32_t* seqs;  // the ids in device memory, or null: they are `ids`
  int32_t ids[kGatherIds];
};
__global__ void gather_tables(const __grid_constant__ Gather g) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int32_t* seqs = g.seqs ? g.seqs : g.ids;
  if (tid < int64_t(g.S) * g.max_pages) {
    const int s = int(tid / g.max_pages), j = int(tid % g.max_pages);
    g.out_table[tid] = g.table[int64_t(seqs[s]) * g.cols + j];
  }
  if (tid < g.S) g.out_length[tid] = g.length[seqs[tid]];
}

}  // namespace dmattn::cuda::kv
