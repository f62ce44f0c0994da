// Split-KV decode over cache pages on the GPU. One CTA per (split, KV head x row chunk, sequence)
// runs up to 16 query rows of one KV head (of the G = Hq/Hkv query heads x Nq new queries: GQA
// packing, so a page is read once per KV head, not once per query head). Pages stream through
// shared memory by cp.async, double-buffered. Both products run on the tensor cores with mma.sync:
// S per 32-key block, E2M1 pages on the integer tensor cores (exact), FP8 pages in FP8 and FP6
// pages widened to E4M3 bytes (exact), scaled by the two E8M0 scales and summed over blocks in
// order as the CPU oracle does;
// P (rounded to bf16, as the oracle) times V in bf16 with fp32 accumulation, or with pv = mxfp8 P
// quantized to MXFP8 per 32 keys times V's MXFP8 codes on the FP8 tensor cores, each block scaled
// by P's and V's scales and summed in block order (the oracle's order). A second kernel merges
// the splits by LSE. At Nq = 1 the work per byte is tiny: the page bytes (K at 4.25 or 8.25 bits,
// V at 16) set the time, so the kernel's job is to keep enough of them in flight.
#include "cuda/decode.cuh"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/buffers.hpp"
#include "cuda/cp_async.cuh"
#include "cuda/fp8.cuh"
#include "cuda/mma.cuh"
#include "cuda/quantize.hpp"
#include "dmattn/error.hpp"
#include "dmattn/format.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int T = kTile;       // keys per page
constexpr int kWarps = 8;      // each owns 16 keys in S and d/8 columns in P.V
constexpr int kThreads = 32 * kWarps;
constexpr int kKeysPerWarp = T / kWarps;
constexpr int kRows = 16;      // query rows per CTA: the M of mma.sync; more rows take more CTAs

struct Params {
  PagedKV kv;
  const uint8_t* q8[2];  // [rows][d] FP8 bytes of q's element values in the high / low format
  const uint8_t* qs[2];  // [rows][d/32] E8M0
  Elem kelem[2];         // K's element type per slot (q's too: it takes the page's format)
  float* part;           // [rows][splits][d + 2]: unnormalised acc, m, l
  int Hq, Nq, G, splits, chunks;
  float scale;
  ScaleRule rule;        // pv = mxfp8: P's 32-key blocks take their scales by this rule
};

constexpr int kStages = 2;  // pages per CTA in flight + computing (see launch)

template <int D, bool kPV8>
struct Smem {  // byte offsets into dynamic shared memory
  static constexpr int NB = D / 32;
  // Rows of K (128 bytes, of which E2M1 and d = 64 use the first half or less) and V (2d bytes)
  // store their 16-byte chunks XOR-swizzled by the row's low 3 bits (swz), so the fragment loads of
  // 8 keys and ldmatrix's 8 rows fall in distinct banks without padding: two CTAs fit an SM.
  // pv = mxfp8: V^T as d rows of 128 E4M3 bytes (swizzled like K), then its E8M0 scales [4][d].
  static constexpr int kKRow = 128;
  static constexpr int kVRow = kPV8 ? T : 2 * D;
  static constexpr int kK = T * kKRow, kS = T * NB, kV = kPV8 ? D * T + 4 * D : T * kVRow;
  static constexpr int kStage = kK + kS + kV;
  static constexpr int kPRow = T + 8;       // floats; A-fragment loads of a half warp hit distinct banks
  static constexpr int kP = kStages * kStage;  // P [kRows][kPRow] floats
  static constexpr int kLut = kP + kRows * kPRow * 4;  // [2][64] FP6 code -> E4M3 byte
  static constexpr int kRowState = kLut + 128;         // m, l, alpha [kRows] floats
  static constexpr int kQa = kRowState + 3 * kRows * 4;  // q's A fragments [2][NB][4][32 lanes] uint32
  static constexpr int kSq = kQa + 2 * NB * 4 * 32 * 4;  // q's block scales [2][NB][kRows] floats
  static constexpr int kP8 = kSq + 2 * NB * kRows * 4;  // pv = mxfp8: P's E4M3 codes [kRows][128], swizzled
  static constexpr int kPs = kP8 + (kPV8 ? kRows * T : 0);  // ... and its block scales [kRows][4] floats
  static constexpr int kBytes = kPs + (kPV8 ? kRows * 4 * 4 : 0);
  static_assert(kK % 16 == 0 && kS % 16 == 0 && kStage % 16 == 0);
};

// E2M1 pages run on the integer tensor cores: twice an E2M1 value is an integer in [-12, 12], so
// a 32-element dot of q and K (both E2M1: q takes the page's format) is an exact int32 / 4. The
// oracle's fp32 sum of those products is exact as well, so these scores match it bit for bit.
// Four codes (16 bits, low nibble first) -> four int8 (2 x value): magnitude and negated magnitude
// by byte permutes of the two 8-entry tables, chosen per byte by the sign (a permute in its
// sign-replicating mode: nibble i's sign bit lands on the top bit of the byte it selects).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {  // PTX prmt, sign mode included
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ uint32_t e2m1x4_to_s8x4(uint32_t x) {
  const uint32_t sel = x & 0x7777u;
  const uint32_t pos = prmt(0x03020100u, 0x0C080604u, sel);  // 0 1 2 3 | 4 6 8 12
  const uint32_t neg = prmt(0xFDFEFF00u, 0xF4F8FAFCu, sel);  // 0 -1 -2 -3 | -4 -6 -8 -12
  const uint32_t mask = prmt(x << 4, x, 0xD9C8u);             // 0xFF where the code is negative
  return (pos & ~mask) | (neg & mask);
}

// Byte offset of byte `b` of row `row` in a swizzled shared-memory tile (16-byte chunks XOR row%8).
__device__ __forceinline__ int swz(int row, int b) { return ((b / 16) ^ (row % 8)) * 16 + b % 16; }

// The B fragment register of 4 consecutive K elements of a row (k = 4t.. of a block): int8 twice
// the value for E2M1, the FP8 byte otherwise (FP6 codes widened to E4M3 by a table, exactly).
template <Elem E>
__device__ __forceinline__ uint32_t k_word(const uint8_t* row, int key, int k, const uint8_t* lut) {
  if constexpr (E == Elem::e2m1) {
    return e2m1x4_to_s8x4(*reinterpret_cast<const uint16_t*>(row + swz(key, k / 2)));
  } else if constexpr (E == Elem::e4m3 || E == Elem::e5m2) {
    return *reinterpret_cast<const uint32_t*>(row + swz(key, k));
  } else {  // FP6: one code per byte
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + swz(key, k));
    return uint32_t(lut[w & 0x3F]) | uint32_t(lut[(w >> 8) & 0x3F]) << 8 | uint32_t(lut[(w >> 16) & 0x3F]) << 16 |
           uint32_t(lut[(w >> 24) & 0x3F]) << 24;
  }
}

// S for this warp's 16 keys (2 tiles of 8) against the CTA's 16 rows: for each 32-block, an mma
// into a fresh accumulator, then s += (sq * sk) * dot, blocks in order (the oracle's order).
// s[n][i]: row g + 8*(i/2), key 8n + 2t + i%2 of the warp's keys.
template <int D, bool kPV8, Elem E>
__device__ __forceinline__ void page_scores(const uint8_t* stage, int key0, const uint32_t (&qa)[D / 32][4],
                                            const float (&sq)[D / 32][2], const uint8_t* lut, float (&s)[2][4]) {
  using S_ = Smem<D, kPV8>;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
#pragma unroll
  for (int c = 0; c < D / 32; ++c)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int key = key0 + 8 * n + g;
      const uint8_t* row = stage + key * S_::kKRow;
      const uint32_t b0 = k_word<E>(row, key, c * 32 + 4 * t, lut), b1 = k_word<E>(row, key, c * 32 + 16 + 4 * t, lut);
      float d[4];
      if constexpr (E == Elem::e2m1) {
        int di[4];
        mma_s8_block(di, qa[c], b0, b1);
#pragma unroll
        for (int i = 0; i < 4; ++i) d[i] = float(di[i]) * 0.25f;  // exact
      } else {
        mma_fp8_block<E == Elem::e5m2>(d, qa[c], b0, b1);
      }
      const uint8_t* ks = stage + S_::kK + (key0 + 8 * n + 2 * t) * S_::NB + c;
      const float sk0 = decode_e8m0(ks[0]), sk1 = decode_e8m0(ks[S_::NB]);
      s[n][0] += (sq[c][0] * sk0) * d[0];
      s[n][1] += (sq[c][0] * sk1) * d[1];
      s[n][2] += (sq[c][1] * sk0) * d[2];
      s[n][3] += (sq[c][1] * sk1) * d[3];
    }
}

// kStages pages per CTA: one computes while the next loads; two CTAs share an SM.
template <int D, bool kPV8>
__global__ void __launch_bounds__(kThreads, 2) decode_kernel(const Params p) {
  constexpr int NB = D / 32, NT = D / kWarps / 8;  // NT column tiles of 8 per warp in P.V
  using S_ = Smem<D, kPV8>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int split = blockIdx.x, hk = blockIdx.y / p.chunks, chunk = blockIdx.y % p.chunks, s = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int r0 = chunk * kRows, rows = min(kRows, p.G * p.Nq - r0);
  // Rows of this CTA: (query head hk*G + (r0+i)/Nq, query (r0+i)%Nq); their q rows are consecutive.
  const int64_t qrow0 = (int64_t(s) * p.Hq + int64_t(hk) * p.G) * p.Nq + r0;
  float* P = reinterpret_cast<float*>(smem + S_::kP);
  uint8_t* lut = smem + S_::kLut;
  float* m = reinterpret_cast<float*>(smem + S_::kRowState);
  float* l = m + kRows;
  float* alpha = l + kRows;

  const int L = p.kv.length[s], np = (L + T - 1) / T, eff = min(p.splits, np);
  auto out_part = [&](int i) { return p.part + ((qrow0 + i) * p.splits + split) * (D + 2); };
  if (split >= eff) {  // more splits than this sequence has pages: an empty partial
    for (int i = tid; i < rows; i += kThreads) out_part(i)[D] = -INFINITY;
    return;
  }
  const int j0 = int(int64_t(split) * np / eff), j1 = int(int64_t(split + 1) * np / eff);
  const int32_t* table = p.kv.table + int64_t(s) * p.kv.max_pages;

  auto issue = [&](int j, int stage) {  // page j of the sequence into a stage buffer
    if (j < j1) {
      const int pid = table[j];
      const int64_t head = int64_t(pid) * p.kv.Hkv + hk;
      uint8_t* st = smem + stage * S_::kStage;
      if (p.kelem[p.kv.slot[pid]] == Elem::e2m1) {  // d/2 packed bytes a row
        const uint8_t* gk = p.kv.codes + int64_t(pid) * p.kv.Hkv * T * D + int64_t(hk) * T * (D / 2);
        for (int i = tid; i < T * D / 32; i += kThreads) {
          const int key = i / (D / 32);
          cp_async16(st + key * S_::kKRow + swz(key, (i % (D / 32)) * 16), gk + i * 16);
        }
      } else {
        const uint8_t* gk = p.kv.codes + int64_t(pid) * p.kv.Hkv * T * D + int64_t(hk) * T * D;
        for (int i = tid; i < T * D / 16; i += kThreads) {
          const int key = i / (D / 16);
          cp_async16(st + key * S_::kKRow + swz(key, (i % (D / 16)) * 16), gk + i * 16);
        }
      }
      const uint8_t* gs = p.kv.scales + head * T * NB;
      for (int i = tid; i < S_::kS / 16; i += kThreads) cp_async16(st + S_::kK + i * 16, gs + i * 16);
      if constexpr (kPV8) {  // V^T rows (one per column) of 128 key bytes, then the scales
        const uint8_t* gv = p.kv.v8 + head * T * D;
        for (int i = tid; i < T * D / 16; i += kThreads) {
          const int col = i / (T / 16);
          cp_async16(st + S_::kK + S_::kS + col * S_::kVRow + swz(col, (i % (T / 16)) * 16), gv + i * 16);
        }
        const uint8_t* gvs = p.kv.vs + head * 4 * D;
        for (int i = tid; i < 4 * D / 16; i += kThreads) cp_async16(st + S_::kK + S_::kS + D * T + i * 16, gvs + i * 16);
      } else {
        const uint8_t* gv = reinterpret_cast<const uint8_t*>(p.kv.v + head * T * D);
        for (int i = tid; i < T * D / 8; i += kThreads) {
          const int key = i / (D / 8);
          cp_async16(st + S_::kK + S_::kS + key * S_::kVRow + swz(key, (i % (D / 8)) * 16), gv + i * 16);
        }
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
  for (int i = 0; i < kStages - 1; ++i) issue(j0 + i, i);

  // q as A fragments (rows g, g+8; zero past this CTA's rows) and its block scales, per slot, in
  // shared memory (registers are the scarce resource at two CTAs an SM); an E2M1 slot's fragments
  // hold int8 twice the value (see e2m1x4_to_s8x4).
  uint32_t* qa = reinterpret_cast<uint32_t*>(smem + S_::kQa);
  float* sq = reinterpret_cast<float*>(smem + S_::kSq);
  for (int i = tid; i < 2 * NB * 4 * 32; i += kThreads) {
    const int sl = i / (NB * 128), c = i / 128 % NB, h = i / 32 % 4, ln = i % 32;
    const int r = ln / 4 + 8 * (h % 2);
    uint32_t w =
        r < rows ? *reinterpret_cast<const uint32_t*>(p.q8[sl] + (qrow0 + r) * D + c * 32 + 16 * (h / 2) + 4 * (ln % 4)) : 0u;
    if (p.kelem[sl] == Elem::e2m1) {
      uint32_t v = 0;
      for (int b = 0; b < 4; ++b) v |= uint32_t(uint8_t(int8_t(2.0f * fp8_decode<false>(uint8_t(w >> (8 * b)))))) << (8 * b);
      w = v;
    }
    qa[i] = w;
  }
  for (int i = tid; i < 2 * NB * kRows; i += kThreads) {
    const int sl = i / (NB * kRows), c = i / kRows % NB, r = i % kRows;
    sq[i] = r < rows ? decode_e8m0(p.qs[sl][(qrow0 + r) * NB + c]) : 0.0f;
  }
  for (int i = tid; i < 128; i += kThreads) {  // FP6 codes widened to E4M3 bytes (exact)
    const Elem e = p.kelem[i / 64];
    lut[i] = (e == Elem::e3m2 || e == Elem::e2m3) ? fp8_encode<false>(decode_elem(e, uint8_t(i % 64))) : 0;
  }
  for (int i = tid; i < kRows; i += kThreads) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  float acc[NT][4];  // this warp's d/8 columns: NT tiles of 8; C fragment of rows g, g+8
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;

  for (int j = j0; j < j1; ++j) {
    const int stage = (j - j0) % kStages;
    cp_async_wait<kStages - 2>();  // page j has landed (this thread's copies)
    __syncthreads();                // ... everyone's; and every warp is done with page j - 1
    issue(j + kStages - 1, (j - j0 + kStages - 1) % kStages);  // into page j - 1's stage
    const uint8_t* st = smem + stage * S_::kStage;
    const int sl = p.kv.slot[table[j]];
    const int keys = min(T, L - j * T);  // keys present in this page
    {  // scores of the warp's 16 keys, written to P (scaled) for the softmax
      float sc[2][4];
      uint32_t qc[NB][4];
      float sqc[NB][2];
#pragma unroll
      for (int c = 0; c < NB; ++c) {
#pragma unroll
        for (int h = 0; h < 4; ++h) qc[c][h] = qa[((sl * NB + c) * 4 + h) * 32 + lane];
        sqc[c][0] = sq[(sl * NB + c) * kRows + g];
        sqc[c][1] = sq[(sl * NB + c) * kRows + g + 8];
      }
      const uint8_t* lt = lut + 64 * sl;
      const int key0 = kKeysPerWarp * warp;
      switch (p.kelem[sl]) {
        case Elem::e4m3: page_scores<D, kPV8, Elem::e4m3>(st, key0, qc, sqc, lt, sc); break;
        case Elem::e5m2: page_scores<D, kPV8, Elem::e5m2>(st, key0, qc, sqc, lt, sc); break;
        case Elem::e3m2: page_scores<D, kPV8, Elem::e3m2>(st, key0, qc, sqc, lt, sc); break;
        case Elem::e2m3: page_scores<D, kPV8, Elem::e2m3>(st, key0, qc, sqc, lt, sc); break;
        case Elem::e2m1: page_scores<D, kPV8, Elem::e2m1>(st, key0, qc, sqc, lt, sc); break;
      }
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 4; i += 2)
          *reinterpret_cast<float2*>(P + (g + 4 * i) * S_::kPRow + key0 + 8 * n + 2 * t) =
              make_float2(sc[n][i] * p.scale, sc[n][i + 1] * p.scale);
    }
    __syncthreads();
    for (int r = warp; r < kRows; r += kWarps) {  // online softmax, one warp per row
      float* pr_row = P + r * S_::kPRow;
      uint8_t* p8_row = smem + S_::kP8 + r * T;  // pv = mxfp8 only
      float* ps_row = reinterpret_cast<float*>(smem + S_::kPs) + r * 4;
      auto zero_row = [&] {  // P = 0 (a padding row, or a row that sees no key of the page)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          pr_row[lane + 32 * i] = 0.0f;
          if constexpr (kPV8) p8_row[swz(r, lane + 32 * i)] = 0;
        }
        if (kPV8 && lane < 4) ps_row[lane] = 0.0f;
        if (lane == 0) alpha[r] = 1.0f;
      };
      if (r >= rows) {  // padding rows: P = 0 keeps their (unused) accumulators finite
        zero_row();
        continue;
      }
      const int q_index = (r0 + r) % p.Nq;
      const int nvalid = min(T, L - p.Nq + q_index + 1 - j * T);  // causal, bottom-right
      float pr[4], mt = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pr[i] = pr_row[lane + 32 * i];
        if (lane + 32 * i < nvalid) mt = fmaxf(mt, pr[i]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float mold = m[r];
      if (nvalid <= 0) {  // this row sees no key of the page
        zero_row();
        continue;
      }
      const float mnew = fmaxf(mold, mt), a = expf(mold - mnew);
      float psum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float e = lane + 32 * i < nvalid ? expf(pr[i] - mnew) : 0.0f;
        psum += e;
        if constexpr (kPV8) {  // P in MXFP8 E4M3, one scale per 32 keys (block i: keys 32i + lane)
          float amax = e;
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
          const uint8_t sc = choose_e8m0(amax, Elem::e4m3, p.rule);
          p8_row[swz(r, lane + 32 * i)] = fp8_encode<false>(e * hd::ldexp2(1.0f, 127 - int(sc)));
          if (lane == 0) ps_row[i] = decode_e8m0(sc);
        } else {
          pr_row[lane + 32 * i] = __uint_as_float(bf16x2_rn(e, 0.0f) << 16);  // P in bf16, as the oracle
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
      __syncwarp();  // every lane has read m[r] before lane 0 replaces it
      if (lane == 0) {
        l[r] = l[r] * a + psum;
        m[r] = mnew;
        alpha[r] = a;
      }
    }
    __syncthreads();
    {  // P.V on the tensor cores: this warp's d/8 columns, 16 keys a step
      const float a0 = alpha[g], a1 = alpha[g + 8];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        acc[n][0] *= a0;
        acc[n][1] *= a0;
        acc[n][2] *= a1;
        acc[n][3] *= a1;
      }
      const uint8_t* V = st + S_::kK + S_::kS;
      const int col0 = warp * (D / kWarps);
      if constexpr (kPV8) {  // per 32-key block: an FP8 mma, scaled by P's and V's block scales
        const uint8_t* p8 = smem + S_::kP8;
        const float* ps = reinterpret_cast<const float*>(smem + S_::kPs);
        for (int c = 0; c * 32 < keys; ++c) {
          uint32_t a[4];
#pragma unroll
          for (int h = 0; h < 4; ++h) {  // rows g / g+8, keys 32c + 4t (+16)
            const int r = g + 8 * (h % 2);
            a[h] = *reinterpret_cast<const uint32_t*>(p8 + r * T + swz(r, 32 * c + 16 * (h / 2) + 4 * t));
          }
          const float p0 = ps[g * 4 + c], p1 = ps[(g + 8) * 4 + c];
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            const int col = col0 + 8 * n + g;
            const uint8_t* vrow = V + col * S_::kVRow;
            float d[4];
            mma_fp8_block<false>(d, a, *reinterpret_cast<const uint32_t*>(vrow + swz(col, 32 * c + 4 * t)),
                                 *reinterpret_cast<const uint32_t*>(vrow + swz(col, 32 * c + 16 + 4 * t)));
            const uint8_t* vs = V + D * T + c * D + col0 + 8 * n + 2 * t;
            const float v0 = decode_e8m0(vs[0]), v1 = decode_e8m0(vs[1]);
            acc[n][0] += (p0 * v0) * d[0];
            acc[n][1] += (p0 * v1) * d[1];
            acc[n][2] += (p1 * v0) * d[2];
            acc[n][3] += (p1 * v1) * d[3];
          }
        }
      } else
      for (int k0 = 0; k0 < keys; k0 += 16) {
        uint32_t a[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {  // rows g / g+8, keys k0 + 2t (+8)
          const float2 x = *reinterpret_cast<const float2*>(P + (g + 8 * (h % 2)) * S_::kPRow + k0 + 8 * (h / 2) + 2 * t);
          a[h] = bf16x2_rn(x.x, x.y);  // exact: P is already bf16-valued
        }
        uint32_t b[4];
        if constexpr (NT == 2) {  // matrices: keys +8 for odd, columns +8 for the upper two
          const int mi = lane / 8, key = k0 + lane % 8 + 8 * (mi % 2);
          ldmatrix_x4_trans(b, V + key * S_::kVRow + swz(key, (col0 + 8 * (mi / 2)) * 2));
          mma_bf16_16816(acc[0], a, b[0], b[1]);
          mma_bf16_16816(acc[NT - 1], a, b[2], b[3]);
        } else {  // one column tile: matrices 2, 3 repeat 0, 1 (their results unused)
          const int mi = lane / 8, key = k0 + lane % 8 + 8 * (mi % 2);
          ldmatrix_x4_trans(b, V + key * S_::kVRow + swz(key, col0 * 2));
          mma_bf16_16816(acc[0], a, b[0], b[1]);
        }
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = g + 8 * (i / 2);
      if (r < rows) out_part(r)[warp * (D / kWarps) + 8 * n + 2 * t + i % 2] = acc[n][i];
    }
  for (int r = tid; r < rows; r += kThreads) {
    out_part(r)[D] = m[r];
    out_part(r)[D + 1] = l[r];
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

// Two stages at two CTAs an SM: measured faster than four stages at one CTA an SM (1.17-1.43x,
// bench/RESULTS.md run 19), i.e. the kernel wants warps to hide its instruction latency more than
// it wants bytes in flight.
template <int D, bool kPV8>
void launch(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = Smem<D, kPV8>::kBytes;
  check(cudaFuncSetAttribute(decode_kernel<D, kPV8>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
        "decode kernel attribute");
  decode_kernel<D, kPV8><<<grid, kThreads, bytes, stream>>>(p);
}

template <int D>
void launch(const Params& p, dim3 grid, bool pv8, cudaStream_t stream) {
  if (pv8)
    launch<D, true>(p, grid, stream);
  else
    launch<D, false>(p, grid, stream);
}

}  // namespace

void decode_paged_async(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                        float scale, int splits, int* nonfinite, cudaStream_t stream) {
  const int64_t S = kv.S, Hkv = kv.Hkv, d = kv.d, Hq = q.shape[1], Nq = q.shape[2];
  if (d != 64 && d != 128) throw Error("the CUDA decode supports head dims 64 and 128 (got " + std::to_string(d) + ")");
  if (q.device != Device::cuda || out.device != Device::cuda) throw Error("decode: q and out must be CUDA tensors");
  if (q.stride[3] != 1 || out.stride[3] != 1) throw Error("the CUDA decode needs unit stride on the head dimension");
  if (q.shape[0] != S || q.shape[3] != d || Hq % Hkv != 0 || out.shape != q.shape)
    throw Error("decode: q and out must be [S, a multiple of Hkv, Nq, d]");
  const bool pv8 = policy.pv == PV::mxfp8;
  if (pv8 ? !(kv.v8 && kv.vs) : !kv.v) throw Error("decode: the pages' V is missing for the policy's pv mode");
  const Format fmt[2] = {policy.high, policy.low};
  Params p{};
  p.kv = kv;
  p.Hq = int(Hq);
  p.Nq = int(Nq);
  p.G = int(Hq / Hkv);
  p.chunks = (p.G * p.Nq + kRows - 1) / kRows;
  p.scale = scale;
  p.rule = policy.scale_rule;
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  // Automatic: about two CTAs per SM over the batch (each split keeps >= 2 pages where it can).
  const int64_t ctas = S * Hkv * p.chunks;
  p.splits = splits > 0 ? splits : int(std::clamp<int64_t>((2 * sms + ctas - 1) / ctas, 1, std::max(1, kv.max_pages / 2)));
  p.splits = std::min(p.splits, std::max(1, kv.max_pages));
  Buffers buf(stream);  // stream-ordered: freed after the enqueued work
  const int64_t rows = S * Hq * Nq;
  QuantTarget qt[2];
  for (int sl = 0; sl < 2; ++sl) {
    qt[sl] = QuantTarget{fmt[sl], buf.alloc<uint8_t>(size_t(rows * d)), buf.alloc<uint8_t>(size_t(rows * d / 32)), true};
    p.q8[sl] = qt[sl].codes;
    p.qs[sl] = qt[sl].scales;
    p.kelem[sl] = format_info(fmt[sl]).elem;
  }
  quantize_rows(q, policy.scale_rule, qt[0], qt[1], stream, nonfinite);  // one read of q for both formats
  p.part = buf.alloc<float>(size_t(rows * p.splits * (d + 2)) * sizeof(float));
  const dim3 grid(unsigned(p.splits), unsigned(Hkv * p.chunks), unsigned(S));
  if (d == 64)
    launch<64>(p, grid, pv8, stream);
  else
    launch<128>(p, grid, pv8, stream);
  check(cudaGetLastError(), "decode kernel");
  const unsigned mblocks = unsigned((rows * d + 255) / 256);
  with_typed(out, [&](auto* typed) {
    merge_splits<<<mblocks, 256, 0, stream>>>(p.part, rows, p.splits, int(d), typed, out.stride[0], out.stride[1],
                                              out.stride[2], int(Hq), int(Nq), lse);
  });
  check(cudaGetLastError(), "merge kernel");
}

void decode_paged(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                  float scale, int splits, cudaStream_t stream) {
  Buffers buf(stream);
  int* bad = buf.alloc<int>(sizeof(int));
  check(cudaMemsetAsync(bad, 0, sizeof(int), stream), "cudaMemset");
  decode_paged_async(kv, policy, q, out, lse, scale, splits, bad, stream);
  int bad_host = 0;
  check(cudaMemcpyAsync(&bad_host, bad, sizeof bad_host, cudaMemcpyDeviceToHost, stream), "decode");
  check(cudaStreamSynchronize(stream), "decode");
  if (bad_host) throw Error("decode_attention: q holds a non-finite value");
}

}  // namespace dmattn::cuda
