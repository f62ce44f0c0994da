// Split-KV decode over cache pages on the GPU. One CTA per (split, KV head x row chunk, sequence)
// runs 8 or 16 query rows of one KV head (of the G = Hq/Hkv query heads x Nq new queries: GQA
// packing, so a page is read once per KV head, not once per query head). Each of the CTA's four
// warps owns one 32-key block of every page and streams it through its own stages, a bulk copy
// (TMA) of the block's record (kv_record.hpp) each. Both
// products run on the tensor cores, transposed so the query rows are the mma's N: S^T per 32-wide
// block of d, E2M1 pages on the integer mma (K and q as bytes of twice their values, exact), FP8 and
// FP6 pages as FP8 block dots (sm_90 has no FP8 mma.sync: two f16 mmas on operands widened exactly,
// mma_fp8_block; widening q once per CTA instead saved 1.5% of the instructions and no time),
// scaled by the two E8M0 scales and summed over blocks in order as the CPU oracle does; the
// softmax stays in registers, in base 2 (the page's row maxima are the only thing the warps exchange);
// P (rounded to bf16, as the oracle) times V in bf16 with fp32 accumulation, or with pv = mxfp8 /
// mxfp4 P quantized to MXFP8 per 32 keys (a warp's block) times V's MXFP8 codes (or MXFP4 codes
// placed as f16) as f16 block dots, scaled by P's and V's block scales. A second kernel merges the
// splits by LSE. At Nq = 1 the work per byte is tiny: the page bytes (K at 4.25 or 8.25 bits, V at
// 16, 8.25 or 4.25) set the time, so the kernel's job is to keep enough of them in flight with few
// instructions per byte.
#include "cuda/decode/decode.cuh"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/capabilities.hpp"
#include "cuda/common/buffers.hpp"
#include "cuda/ptx/fp8.cuh"
#include "cuda/common/head_dims.hpp"
#include "cuda/common/launch.hpp"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/pdl.cuh"
#include "cuda/common/rotate_lanes.cuh"
#include "cuda/decode/splits.hpp"
#include "cuda/ptx/tma.cuh"
#include "dmattn/error.hpp"
#include "dmattn/format.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/rotation.hpp"

namespace dmattn::cuda {
namespace {

constexpr int T = kTile;          // keys per page
constexpr int kWarps = T / 32;    // warp w owns keys 32w..32w+31 of every page: one MX block of P
constexpr int kThreads = 32 * kWarps;
// CTAs an SM (kCtas); registers and shared memory are sized for it. The kernel is latency-bound, so
// more warps an SM help where the grid fills the GPU (decode_plan weighs that against waves). Most an
// instance fits: with 8-row CTAs, four where V is MXFP4 (127 registers, two stages a warp), three where
// it is MXFP8 (two stages); two for bf16 V (twice the stage bytes) and 16-row CTAs (~200 registers).
constexpr int max_ctas(int vbits, int nr) { return nr == 1 ? (vbits == 4 ? 4 : vbits == 8 ? 3 : 2) : 2; }

struct Params {
  PagedKV kv;
  const void* q;         // [S, Hq, Nq, d] f32 / f16 / bf16, unit stride on d: quantized by each CTA
  DType qdt;
  int64_t qsb, qsh, qsn;
  int* nonfinite;        // set to 1 where q holds NaN / Inf
  Elem kelem[2];         // K's element type per slot (q's too: it takes the page's format)
  float* part;           // [rows][splits][d + 2]: unnormalised acc, m (raw score units), l
  int Hq, Nq, G, splits, chunks;
  const float* sink;     // [rows][sink_keys]: the sink keys' exact scores (raw units), or null
  int sink_keys;
  int window_left;       // sliding window: a query at position pos sees keys [pos - window_left, pos]; INT32_MAX
                         // unbounded. Instances of two CTAs an SM only (kWindow), which the host then runs.
  float scale;           // softmax scale x log2(e): the softmax runs in base 2 (ex2.approx) on (s - m) x scale
  ScaleRule rule;        // pv != bf16: P's 32-key blocks take their scales by this rule
};

// Shared memory. Each warp streams its own 32 keys of every page through its own kStages buffers,
// one record (kv_record.hpp) each, brought by one bulk copy and signalled by the stage's mbarrier
// (so it waits for its own copies only); the warps meet once a page, to agree on the rows' maximum.
// kNR: query rows per CTA in tiles of 8 (the N of mma.sync; more rows take more CTAs).
template <int D, int kVB, int kNR, int kCtas>
struct Smem {  // byte offsets into dynamic shared memory
  static constexpr bool kPV8 = kVB != 16;  // V in MX codes (8 or 4 bits)
  static constexpr int NB = D / 32, kRows = 8 * kNR;

  // Per warp and stage: a record. K rows (E2M1: D/2 bytes, else D) end where the keys' E8M0 scales
  // [32][NB] begin, then V: bf16 rows [32 keys][d], or (pv = mxfp8 / mxfp4) V^T [d][32 keys] E4M3
  // bytes / E2M1 nibbles (keys in fragment order) and the block's E8M0 scales [d].
  static constexpr int kWarpStage = record_bytes(D, kVB);
  static constexpr int kQbBytes = 2 * NB * kNR * 2 * 32 * 4;
  static constexpr int kBarBytes = 4 * kWarps * 8;  // mbarriers, room for four stages
  static constexpr int kMisc = 128 + 2 * kWarps * kRows * 4 + kQbBytes + 2 * NB * kRows * 4 + kBarBytes;
  // As many stages as leave kCtas CTAs an SM: more bytes in flight per warp.
  static constexpr int kStages = std::min(4, ((227 / kCtas - 1) * 1024 - kMisc) / (kWarps * kWarpStage));
  static constexpr int kLut = kStages * kWarps * kWarpStage;  // [2][64] FP6 code -> E4M3 byte
  static constexpr int kMax = kLut + 128;                       // [2][kWarps][kRows] floats: row maxima
  static constexpr int kQb = kMax + 2 * kWarps * kRows * 4;     // q's B fragments [2][NB][kNR][2][32 lanes] uint32
  static constexpr int kSq = kQb + kQbBytes;                    // q's block scales [2][NB][kRows] floats
  static constexpr int kBar = kSq + 2 * NB * kRows * 4;         // [kWarps][kStages] uint64_t: a stage's copy landed
  static constexpr int kBytes = kBar + kBarBytes;
  static_assert(kStages >= 2 && kWarpStage % 16 == 0 && kBar % 8 == 0 && kBytes - kLut == kMisc);
  static_assert(kWarps * kRows * D * 4 <= kLut, "the final cross-warp sum reuses the stage buffers");
};

// The d index of contraction slot k of a 32-wide block, in both K's A and q's B fragments: lane t's
// slots 4t..4t+3 and 16+4t..16+4t+3 are d = 8t..8t+7, so a lane reads one 8-byte run of FP8 codes
// (4 bytes of E2M1) per key and block. A dot is a sum, so permuting its terms in both operands alike
// leaves it unchanged (up to the mma's own summation order, which the oracle does not fix either).
__device__ __forceinline__ int d_of_slot(int k) { return 8 * ((k % 16) / 4) + 4 * (k / 16) + k % 4; }

// E2M1 pages run on the FP8 tensor cores with their codes widened to E4M3 bytes (exact): the
// products of two E2M1 values are multiples of 1/4 below 37 and a 32-term sum stays below 2^11, so
// the mma's sum is exact (GpuMma.Fp8BlockDotPrecision asserts it) and equals the oracle's.
// (fp8.cuh: e2m1x4_to_e4m3x4 widens four codes a word.)

// The E8M0 scale code in byte c of `word` as a float. Cache pages hold no NaN scale (append rejects
// non-finite input) and code 0 (2^-127) only scales all-zero blocks, so the plain exponent field is
// enough here: two instructions instead of decode_e8m0's special cases.
// (The byte goes to bits 16..23 by one permute and up 7 by a multiply on the FMA pipe: shift, mask and
// shift took three instructions, two of them on the busier ALU pipe.)
__device__ __forceinline__ float e8m0_of_byte(uint32_t word, int c) {
  return __uint_as_float(prmt(word, 0u, 0x4044u | uint32_t(c) << 8) << 7);
}

// A fragment registers (slots 4t..4t+3 and 16+4t..) of block c of a key row (D/2 bytes for E2M1, else
// D; chunks swizzled, kv_record.hpp): FP8 bytes (E2M1 and FP6 codes widened to E4M3, exactly).
template <int D, Elem E>
__device__ __forceinline__ void k_words(const uint8_t* row, int key, int c, int t, const uint8_t* lut, uint32_t& b0,
                                        uint32_t& b1) {
  if constexpr (E == Elem::e2m1) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + swizzled(D / 32, key, c * 16 + 4 * t));
    b0 = e2m1x4_to_e4m3x4(w);
    b1 = e2m1x4_to_e4m3x4(w >> 16);
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(row + swizzled(D / 16, key, c * 32 + 8 * t));
    if constexpr (E == Elem::e4m3 || E == Elem::e5m2) {
      b0 = w.x;
      b1 = w.y;
    } else {  // FP6: one code per byte
      auto widen = [&](uint32_t x) {
        return uint32_t(lut[x & 0x3F]) | uint32_t(lut[(x >> 8) & 0x3F]) << 8 | uint32_t(lut[(x >> 16) & 0x3F]) << 16 |
               uint32_t(lut[(x >> 24) & 0x3F]) << 24;
      };
      b0 = widen(w.x);
      b1 = widen(w.y);
    }
  }
}

// The key's E8M0 block scales as one word (byte c = block c).
template <int NB>
__device__ __forceinline__ uint32_t scale_word(const uint8_t* ks, int key) {
  if constexpr (NB == 4) return *reinterpret_cast<const uint32_t*>(ks + key * 4);
  else return *reinterpret_cast<const uint16_t*>(ks + key * 2);
}

// The oracle's blockwise promotion of one block's mma result d (an m16n8 fragment: rows g, g + 8 x
// columns 2t, 2t + 1) into s: s += (row scale x column scale) * d. m0, m1: the scales of rows g and
// g + 8 (keys for S^T, channels for O^T); n: those of columns 2t, 2t + 1 (query rows).
__device__ __forceinline__ void promote(float (&s)[4], float m0, float m1, float2 n, const float* d) {
  s[0] += (m0 * n.x) * d[0];
  s[1] += (m0 * n.y) * d[1];
  s[2] += (m1 * n.x) * d[2];
  s[3] += (m1 * n.y) * d[3];
}

// The A fragment words of block c of an E2M1 key row as twice its values in unsigned bytes, split
// by sign (pos: slots 4t.. and 16+4t..; neg likewise; e2m1_bytes.hpp): 7 instructions for 8 codes.
template <int D>
__device__ __forceinline__ void k_split_words(const uint8_t* row, int key, int c, int t, uint32_t& p0, uint32_t& p1,
                                              uint32_t& n0, uint32_t& n1) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(row + swizzled(D / 32, key, c * 16 + 4 * t)), f = w ^ 0x88888888u;
  p0 = e2m1x4_pos_x2(w);
  p1 = e2m1x4_pos_x2(w >> 16);
  n0 = e2m1x4_neg_x2(f);
  n1 = e2m1x4_neg_x2(f >> 16);
}

// The E2M1 block dot x4 as pos.q - neg.q, two independent integer mmas (exact). Both sums start
// from the bits of 1.5 * 2^23 (each stays within 2^22 of it), so they land in floats of one binade and
// one subtraction each gives the dot exactly, with no int-to-float conversion.
__device__ __forceinline__ void mma_e2m1_block(float d[4], const uint32_t (&pos)[4], const uint32_t (&neg)[4], uint32_t b0,
                                               uint32_t b1) {
  constexpr int kMagic = 0x4B400000;
  const int c0[4] = {kMagic, kMagic, kMagic, kMagic};
  int dp[4], dn[4];
  mma_u8s8_block(dp, pos, b0, b1, c0);
  mma_u8s8_block(dn, neg, b0, b1, c0);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = __int_as_float(dp[i]) - __int_as_float(dn[i]);
}

// S^T = K.q^T for the warp's 32 keys (2 tiles of 16, the mma's M) against the CTA's rows (kNR tiles
// of 8, its N): with the query rows in N, a GQA group of 4 or 8 rows wastes no more than half of
// the mma (in M it wasted three quarters). Per 32-wide block of d an mma into a fresh accumulator,
// then s += (sk * sq) * dot, blocks in order (the oracle's order). E2M1 pages run the integer mma
// (mma_e2m1_block; their sq holds a quarter of q's scale), the others the FP8 one.
// s[mt][nr][i]: key 16mt + g + 8*(i/2) of the warp's keys, row 8nr + 2t + i%2.
template <int D, int kNR, Elem E>
__device__ __forceinline__ void block_scores(const uint8_t* rec, const uint32_t* qb, const float* sq, const uint8_t* lut,
                                             float (&s)[2][kNR][4]) {
  constexpr int NB = D / 32, kRows = 8 * kNR;
  constexpr bool kInt = E == Elem::e2m1;
  constexpr int kRow = record_k_row(D, kInt);
  const uint8_t *K = rec + record_k(D, kInt), *ks = rec + record_k_scales(D);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t w[2][2];  // the scale words of keys 16mt + g + 8h
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    w[mt][0] = scale_word<NB>(ks, 16 * mt + g);
    w[mt][1] = scale_word<NB>(ks, 16 * mt + g + 8);
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][nr][i] = 0.0f;
  }
  // The E2M1 path, unrolled over every block, needs more registers than the many-CTA instances (168 at
  // three, 128 at four) or the 16-row bf16-V one (255) have (ptxas spilled): two blocks at a time fit, or
  // one at 16 rows.
  constexpr int kUnrollC = kInt ? 3 - kNR : NB;
#pragma unroll kUnrollC
  for (int c = 0; c < NB; ++c) {
    uint32_t b[kNR][2];
    float2 sqr[kNR];  // rows 8nr + 2t, +1
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr) {
      b[nr][0] = qb[((c * kNR + nr) * 2) * 32 + lane];
      b[nr][1] = qb[((c * kNR + nr) * 2 + 1) * 32 + lane];
      sqr[nr] = *reinterpret_cast<const float2*>(sq + c * kRows + 8 * nr + 2 * t);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int key = 16 * mt + g;
      uint32_t a[4], an[4];
      if constexpr (kInt) {
        k_split_words<D>(K + key * kRow, key, c, t, a[0], a[2], an[0], an[2]);
        k_split_words<D>(K + (key + 8) * kRow, key + 8, c, t, a[1], a[3], an[1], an[3]);
      } else {
        k_words<D, E>(K + key * kRow, key, c, t, lut, a[0], a[2]);
        k_words<D, E>(K + (key + 8) * kRow, key + 8, c, t, lut, a[1], a[3]);
      }
      const float sk0 = e8m0_of_byte(w[mt][0], c), sk1 = e8m0_of_byte(w[mt][1], c);
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr) {
        float d[4];
        if constexpr (kInt)
          mma_e2m1_block(d, a, an, b[nr][0], b[nr][1]);
        else
          mma_fp8_block<E == Elem::e5m2>(d, a, b[nr][0], b[nr][1]);
        promote(s[mt][nr], sk0, sk1, sqr[nr], d);
      }
    }
  }
}

// x reduced by op over the 8 lanes of the same t (an accumulator column's rows g).
template <class Op>
__device__ __forceinline__ float over_g(float x, Op op) {
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// Per-row values (rows 8nr + 2t + r of S^T's columns) reduced over g and stored, a float a row.
template <int kNR, class Op>
__device__ __forceinline__ void store_rows(float* dst, const float (&v)[kNR][2], Op op) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float x = over_g(v[nr][r], op);
      if (g == 0) dst[8 * nr + 2 * t + r] = x;
    }
}
constexpr auto kMaxOp = [](float a, float b) { return fmaxf(a, b); };
constexpr auto kSumOp = [](float a, float b) { return a + b; };

// P's MXFP8 E4M3 block over this warp's 32 keys (one MX block) for rows 8nr + 2t + r: its E8M0
// scale as a float (ps) and the factor to element range (inv), the amax taken over the lanes g.
template <int kNR>
__device__ __forceinline__ void p_block_scales(const float (&sc)[2][kNR][4], int nr, ScaleRule rule, float (&inv)[2],
                                               float (&ps)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float amax = 0.0f;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) amax = fmaxf(amax, fmaxf(sc[mt][nr][r], sc[mt][nr][2 + r]));
    const uint8_t e = choose_e8m0_nonneg(over_g(amax, kMaxOp), Elem::e4m3, rule);  // p in [0, 1]: finite
    inv[r] = inverse_e8m0(e);
    ps[r] = decode_e8m0(e);
  }
}

// An 8x8 matrix of 16-bit pairs transposed across the warp: lane (g, t) gives row g, columns 2t and
// 2t+1, and receives row g of the transpose (columns 2t, 2t+1 of it).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// kStages pages per warp in flight; two to four CTAs of four warps share an SM (kCtas). Per
// page, each warp: S^T of its 32 keys on the tensor cores, the rows' maxima exchanged through
// shared memory (the one CTA barrier of the page: the oracle's softmax takes the page's maximum), P
// in registers, O^T += V^T.P^T on the tensor cores into the warp's own accumulator of all d columns
// (P^T's B fragments come from S^T's accumulators by movmatrix). Every warp rescales by the same
// factors, so the warps' accumulators and sums add up at the end.
template <int D, int kVB, int kNR, int kCtas>
__global__ void __launch_bounds__(kThreads, kCtas) decode_kernel(const Params p) {
  constexpr int NB = D / 32, MD = D / 16;  // MD tiles of 16 columns of d in O^T
  using S_ = Smem<D, kVB, kNR, kCtas>;
  constexpr bool kPV8 = S_::kPV8;
  constexpr int kStages = S_::kStages, kRows = S_::kRows;
  extern __shared__ __align__(128) uint8_t smem[];
  // The merge kernel may launch now (programmatic dependent launch): it waits for this grid's
  // completion itself (griddepcontrol.wait), so only its launch latency overlaps this kernel.
  allow_dependents();
  const int split = blockIdx.x, hk = blockIdx.y / p.chunks, chunk = blockIdx.y % p.chunks, s = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int r0 = chunk * kRows, rows = min(kRows, p.G * p.Nq - r0);
  // Rows of this CTA: (query head hk*G + (r0+i)/Nq, query (r0+i)%Nq); their q rows are consecutive.
  const int64_t qrow0 = (int64_t(s) * p.Hq + int64_t(hk) * p.G) * p.Nq + r0;
  uint8_t* lut = smem + S_::kLut;
  float* rmax = reinterpret_cast<float*>(smem + S_::kMax);  // [page parity][warp][row]

  // Sliding windows in the instances of two CTAs an SM: their registers do not fit under three or four
  // (ptxas spilled the four-CTA instance), and the host runs every windowed decode at two.
  constexpr bool kWindow = kCtas == 2;
  // Pages [jlo, np): jlo the first page the earliest row's window (position L - Nq) reaches.
  const int L = p.kv.length_of(s), np = (L + T - 1) / T;
  const int jlo = kWindow ? max(0, L - p.Nq - p.window_left) / T : 0, eff = min(p.splits, np - jlo);
  auto out_part = [&](int i) { return p.part + ((qrow0 + i) * p.splits + split) * (D + 2); };
  if (split >= eff) {  // more splits than this sequence has pages: an empty partial (zeros, m = -inf)
    for (int i = tid; i < rows * (D + 2); i += kThreads) out_part(i / (D + 2))[i % (D + 2)] = i % (D + 2) == D ? -INFINITY : 0.0f;
    return;
  }
  const int j0 = jlo + int(int64_t(split) * (np - jlo) / eff), j1 = jlo + int(int64_t(split + 1) * (np - jlo) / eff);
  const int32_t* table = p.kv.row(s);
  auto stage_of = [&](int i) { return smem + (i * kWarps + warp) * S_::kWarpStage; };

  // Page ids and formats of this split, 32 pages at a time in the warp's lanes (one a lane), the
  // next 32 loaded a window ahead: the two dependent global loads stay off the per-page path.
  auto load_window = [&](int base, int& pid, int& sl) {
    const int jj = base + lane;
    pid = jj < j1 ? table[jj] : 0;
    sl = jj < j1 ? p.kv.slot[pid] : 0;
  };
  int win = j0, cur_pid, cur_sl, nxt_pid, nxt_sl;
  load_window(win, cur_pid, cur_sl);
  load_window(win + 32, nxt_pid, nxt_sl);
  uint32_t ring = 0;  // bit i: the format slot of the page in stage i
  // Both slots' element types in one register: indexing the parameter by a run-time slot is a
  // dependent constant load on every page's path (the prefill measured one such load at 3.5% of its stalls).
  const uint32_t kel = uint32_t(p.kelem[0]) | uint32_t(p.kelem[1]) << 8;
  auto elem_of = [&](int sl) { return Elem((kel >> (8 * sl)) & 0xFF); };

  // This warp's barriers, one a stage: lane 0 announces a record's bytes and issues its bulk copy; the
  // copy's completion flips the barrier's phase. Stages fill in turn, so the parity of the phase that
  // page j's copy completes flips each time the stage index wraps.
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S_::kBar) + warp * kStages;
  // This warp's record of page 0 and the distance between pages' records (< 2^32 bytes: decode_paged_async checks).
  const uint8_t* rec0 = p.kv.rec + (int64_t(hk) * kWarps + warp) * S_::kWarpStage;
  const uint32_t page_stride = uint32_t(p.kv.Hkv) * kWarps * S_::kWarpStage;
  if (lane == 0) {
    for (int i = 0; i < kStages; ++i) tma::init(bars + i, 1);
    tma::fence_init();  // visible to the copy engine
  }
  __syncwarp();

  auto issue = [&](int j, int stage) {  // this warp's 32 keys of page j (one record) into its stage buffer
    if (j >= j1) return;
    if (j == win + 32) {
      win = j;
      cur_pid = nxt_pid;
      cur_sl = nxt_sl;
      load_window(win + 32, nxt_pid, nxt_sl);
    }
    const int pid = __shfl_sync(0xffffffffu, cur_pid, j - win), sl = __shfl_sync(0xffffffffu, cur_sl, j - win);
    ring = (ring & ~(1u << stage)) | uint32_t(sl) << stage;
    // The record from its K codes on: E2M1 rows are half as long and start later in the region.
    const int first = record_k(D, elem_of(sl) == Elem::e2m1);
    if (lane == 0) {
      const uint8_t* src = rec0 + uint64_t(uint32_t(pid)) * page_stride + first;
      tma::arrive_expect(bars + stage, uint32_t(S_::kWarpStage - first));
      tma::load_bytes(stage_of(stage) + first, src, uint32_t(S_::kWarpStage - first), bars + stage);
    }
  };
  for (int i = 0; i < kStages - 1; ++i) issue(j0 + i, i);

  // Each row's element offset in q, computed once by lane r (32-bit divisions by Nq per element took
  // most of the prologue's ~16K instructions a CTA, ncu), then read with shuffles.
  int64_t row_off = 0;
  if (lane < rows) {
    const int rr = r0 + lane;  // the row within the KV head's G x Nq
    row_off = s * p.qsb + int64_t(hk * p.G + rr / p.Nq) * p.qsh + int64_t(rr % p.Nq) * p.qsn;
  }
  // q's values for the prologue's quantization (below): a warp per (row, 32-block) of the real rows (4
  // of 8 at G = 4, Nq = 1), a lane per element. Every load is issued before any arithmetic, as raw bits
  // (a conversion next to its load would wait for it): one dependent load an iteration serialised the
  // DRAM latency (29% of the kernel's stall samples at B = 1, 8k). After the first page
  // copies' issue: issued ahead of the page table's loads, they delayed the copies of a cold step
  // (ncu).
  constexpr int kJobs = (kRows * NB + kWarps - 1) / kWarps;
  const bool q32 = p.qdt == DType::f32;
  // Launched after the transforms' query pre-pass as its programmatic dependent, the kernel has issued
  // its first page copies by now; q and the sink scores are the pre-pass's output. (A no-op otherwise.)
  wait_prior_grids();
  uint32_t qraw[kJobs];  // f32 bits, or a 16-bit value's in the low half
#pragma unroll
  for (int i = 0; i < kJobs; ++i) {
    const int it = warp + i * kWarps;  // uniform across the warp (the shuffle below)
    qraw[i] = 0;
    if (it < rows * NB) {
      const int64_t off = __shfl_sync(0xffffffffu, row_off, it / NB) + (it % NB) * 32 + lane;
      qraw[i] = q32 ? static_cast<const uint32_t*>(p.q)[off] : static_cast<const uint16_t*>(p.q)[off];
    }
  }

  // q's rows quantized here, in both formats, as the codec's quantize_mx_block (the CPU decode's
  // rule; a CTA's rows are a few KB, so no separate pass or launch): a warp per (format slot, row,
  // 32-block), a lane per element; FP8 bytes of the element values (E2M1/FP6 values widened to
  // E4M3) go to the still unused last stage buffer, the block scale to sq.
  uint32_t* qb = reinterpret_cast<uint32_t*>(smem + S_::kQb);
  float* sq = reinterpret_cast<float*>(smem + S_::kSq);  // [slot][c][row]
  uint8_t* q8 = stage_of(kStages - 1) - warp * S_::kWarpStage;  // [slot][kRows][D] bytes
  static_assert(2 * kRows * D <= kWarps * S_::kWarpStage);
  for (int i = tid; i < 2 * (kRows - rows) * D; i += kThreads) {  // rows past the GQA group's: zero codes and scales
    const int sl = i / ((kRows - rows) * D), k = i % ((kRows - rows) * D);
    q8[(sl * kRows + rows) * D + k] = 0;
    if (k % 32 == 0) sq[(sl * NB + k % D / 32) * kRows + rows + k / D] = 0.0f;
  }
  // q's values (loaded above) quantized, both slots from one load and one amax.
#pragma unroll
  for (int i = 0; i < kJobs; ++i) {
    const int it = warp + i * kWarps;
    if (it >= rows * NB) break;
    const int r = it / NB, c = it % NB;
    const uint16_t h = uint16_t(qraw[i]);
    const float v = q32 ? __uint_as_float(qraw[i]) : p.qdt == DType::f16 ? to_float(fp16{h}) : to_float(bf16{h});
    const bool bad = __any_sync(0xffffffffu, !hd::is_finite(v));
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0 && bad && p.nonfinite) *p.nonfinite = 1;
#pragma unroll 1
    for (int sl = 0; sl < 2; ++sl) {  // rolled: the encoders' branches twice over would double the code
      const Elem e = elem_of(sl);
      const uint8_t sc = bad ? kE8M0NaN : choose_e8m0_nonneg(amax, e, p.rule);  // amax finite unless bad
      // 2^-X as one factor (a product by a power of two rounds once, as the codec's ldexp); the element
      // code as its FP8 byte: E4M3/E5M2 by the hardware conversion (the codec's encode_elem), E2M1 by
      // the branch-free encoder widened to E4M3, FP6 through the codec (rare: no fast path).
      const float x = v * inverse_e8m0(sc);
      uint8_t code;
      if (e == Elem::e4m3)
        code = fp8_encode<false>(x);
      else if (e == Elem::e5m2)
        code = fp8_encode<true>(x);
      else if (e == Elem::e2m1)
        code = uint8_t(e2m1x4_to_e4m3x4(encode_e2m1_fast(x)));
      else
        code = fp8_encode<false>(decode_elem(e, encode_elem(e, x)));
      q8[(sl * kRows + r) * D + c * 32 + lane] = sc == kE8M0NaN ? uint8_t(0) : code;
      // E2M1: block_scores' integer dot is 4x the values' (both operands doubled); a power of two, exact.
      if (lane == 0) sq[(sl * NB + c) * kRows + r] = decode_e8m0(sc) * (e == Elem::e2m1 ? 0.25f : 1.0f);
    }
  }
  __syncthreads();
  // q^T as B fragments (row 8nr + g; contraction slots ordered by d_of_slot), per slot: FP8 bytes, or
  // for an E2M1 slot twice the values as signed bytes (block_scores' integer mma).
  for (int i = tid; i < 2 * NB * kNR * 2 * 32; i += kThreads) {
    const int sl = i / (NB * kNR * 64), c = i / (kNR * 64) % NB, nr = i / 64 % kNR, h = i / 32 % 2, ln = i % 32;
    uint32_t x = *reinterpret_cast<const uint32_t*>(q8 + (sl * kRows + 8 * nr + ln / 4) * D + c * 32 + d_of_slot(16 * h + 4 * (ln % 4)));
    if (p.kelem[sl] == Elem::e2m1) {
      uint32_t y = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int v = int(2.0f * fp8_decode<false>(uint8_t(x >> (8 * k))));  // E2M1 values: |2v| <= 12, exact
        y |= uint32_t(uint8_t(int8_t(v))) << (8 * k);
      }
      x = y;
    }
    qb[i] = x;
  }
  for (int i = tid; i < 128; i += kThreads) {  // FP6 codes widened to E4M3 bytes (exact)
    const Elem e = p.kelem[i / 64];
    lut[i] = (e == Elem::e3m2 || e == Elem::e2m3) ? fp8_encode<false>(decode_elem(e, uint8_t(i % 64))) : 0;
  }
  tma::fence_proxy_async();  // q8's generic writes and reads are ordered before the copies into its buffer
  __syncthreads();

  // The last key (exclusive, absolute) each of this thread's rows (8nr + 2t + r) sees: causal, bottom-right.
  int kend[kNR][2];
#pragma unroll
  for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 8 * nr + 2 * t + r;
      kend[nr][r] = row < rows ? L - p.Nq + (r0 + row) % p.Nq + 1 : L;
    }
  // kWindow: a row sees key k where 0 <= kend - 1 - k <= window_left (the keys before it in its
  // window), one unsigned compare; pages from whole0 on start inside the last row's window.
  const int whole0 = kWindow ? max(0, L - 1 - p.window_left + T - 1) / T : 0;
  float acc[MD][kNR][4];  // O^T: columns 16md + g (+8) of rows 8nr + 2t (+1), over this warp's keys
#pragma unroll
  for (int md = 0; md < MD; ++md)
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[md][nr][i] = 0.0f;
  float m[kNR][2], l[kNR][2];  // l: this lane's share of the row sums
#pragma unroll
  for (int nr = 0; nr < kNR; ++nr) m[nr][0] = m[nr][1] = -INFINITY, l[nr][0] = l[nr][1] = 0.0f;

  // stage: page j's buffer; fill: page j - 1's (free at j0: the first kStages - 1 pages took the others).
  int stage = 0, fill = kStages - 1;
  uint32_t parity = 0;
  for (int j = j0; j < j1; ++j) {
    tma::wait(bars + stage, parity);  // this warp's record of page j has landed
    __syncwarp();  // and every lane is done with page j - 1's buffer, which the next copy takes
    issue(j + kStages - 1, fill);
    const uint8_t* st = stage_of(stage);
    const int sl = (ring >> stage) & 1;
    float sc[2][kNR][4];
    {
      const uint32_t* qs = qb + sl * NB * kNR * 64;
      const float* sqs = sq + sl * NB * kRows;
      const uint8_t* lt = lut + 64 * sl;
      switch (elem_of(sl)) {  // E2M1 first: the default's low format, most pages' (the compare chain's order)
        case Elem::e2m1: block_scores<D, kNR, Elem::e2m1>(st, qs, sqs, lt, sc); break;
        case Elem::e4m3: block_scores<D, kNR, Elem::e4m3>(st, qs, sqs, lt, sc); break;
        case Elem::e5m2: block_scores<D, kNR, Elem::e5m2>(st, qs, sqs, lt, sc); break;
        case Elem::e3m2: block_scores<D, kNR, Elem::e3m2>(st, qs, sqs, lt, sc); break;
        case Elem::e2m3: block_scores<D, kNR, Elem::e2m3>(st, qs, sqs, lt, sc); break;
      }
    }
    if (j * T < p.sink_keys) {  // sink keys: their exact scores replace the quantized ones
      const int kb = j * T + 32 * warp + g;
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int key = kb + 16 * mt + 8 * (i / 2), row = 8 * nr + 2 * t + i % 2;
            if (key < p.sink_keys && row < rows) sc[mt][nr][i] = p.sink[(qrow0 + row) * p.sink_keys + key];
          }
    }
    // Mask (keys past each row's end: -inf), the rows' maxima over this warp's raw scores (the scale is
    // applied to s - m below, scale > 0).
    const int kbase = j * T + 32 * warp + g;
    const bool whole = (j + 1) * T <= L - p.Nq + 1 && (!kWindow || j >= whole0);  // every row sees every key of the page
    float mx[kNR][2];
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr) {
      mx[nr][0] = mx[nr][1] = -INFINITY;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float& x = sc[mt][nr][i];
          const int key = kbase + 16 * mt + 8 * (i / 2);
          if (!whole && (kWindow ? uint32_t(kend[nr][i % 2] - 1 - key) > uint32_t(p.window_left) : key >= kend[nr][i % 2]))
            x = -INFINITY;
          mx[nr][i % 2] = fmaxf(mx[nr][i % 2], x);
        }
    }
    float* red = rmax + (j & 1) * kWarps * kRows;  // two buffers: a warp runs at most a page ahead
    store_rows<kNR>(red + warp * kRows, mx, kMaxOp);
    __syncthreads();
    float alpha[kNR][2], mref[kNR][2];
    bool rescale = false;
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 8 * nr + 2 * t + r;
        float pm = red[row];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) pm = fmaxf(pm, red[w * kRows + row]);
        const float mnew = fmaxf(m[nr][r], pm);
        // A row that has seen no key yet keeps its state (as if the page were skipped).
        alpha[nr][r] = mnew == -INFINITY ? 1.0f : exp2_approx((m[nr][r] - mnew) * p.scale);
        mref[nr][r] = mnew == -INFINITY ? 0.0f : mnew;
        m[nr][r] = mnew;
        l[nr][r] *= alpha[nr][r];
        rescale |= alpha[nr][r] != 1.0f;
      }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // Base 2 on the SFU: FADD, FMUL and a MUFU, where expf took ~9 instructions. The scale (with
          // log2 e) multiplies s - m, not s: scaling s first rounds each logit at its own magnitude, an
          // error of |logit| x 2^-24 in the exponent that the difference then keeps (4e-5 rel. L2 against
          // the oracle at d = 64, whose scale 1/8 is exact on the CPU); s - m is exact near the maximum,
          // where P matters. masked: -inf x scale = -inf, 2^-inf = 0.
          sc[mt][nr][i] = exp2_approx((sc[mt][nr][i] - mref[nr][i % 2]) * p.scale);
          l[nr][i % 2] += sc[mt][nr][i];
        }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int md = 0; md < MD; ++md)
#pragma unroll
        for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[md][nr][i] *= alpha[nr][i % 2];
    }
    const uint8_t* V = st + record_v(D);
    if constexpr (kPV8) {
      // P in MXFP8 E4M3, one scale per row over the warp's 32 keys (one MX block). The codes of
      // (key, rows 2t, 2t+1) widened to f16 and times their block scale x 2^14 (a power of two in f16,
      // so the products are P's values x 2^14, exact down to 2^-35; a block whose scale x 2^14 is
      // below f16's 2^-24 holds values under 448 x 2^-38 and becomes zeros) go to P^T's B fragments
      // (row g, keys 2t, 2t+1 of each 8-key group) by movmatrix: bq[nr][q] holds keys 8q + 2t, 8q + 2t + 1,
      // the f16 mma's slots in natural order over two m16n8k16 (keys 0..15, 16..31). With P's scale in
      // its values, each block's promotion is one FFMA an element. V^T's A fragments hold the same keys:
      // E4M3 bytes 8t.. of a column's 32 keys (vt_position) widened to f16 (the 2^-14 goes into V's
      // scale), or an E2M1 word placed as f16 values x 2^-14 (e2m1x8_to_f16x4), which cancels P's 2^14.
      uint32_t bq[kNR][4];
#pragma unroll
      for (int nr = 0; nr < kNR; ++nr) {
        float inv[2], ps[2];
        p_block_scales<kNR>(sc, nr, p.rule, inv, ps);
        const uint32_t s2 = f16x2_rn(ps[0] * 16384.0f, ps[1] * 16384.0f);
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // key groups 0..3 (keys 8q..8q+7): (mt, half) = (q / 2, q % 2)
          const float* x = sc[q / 2][nr] + 2 * (q % 2);
          const uint32_t h = fp8x2_to_f16x2<false>(fp8x2_encode<false>(x[0] * inv[0], x[1] * inv[1]));
          bq[nr][q] = movmatrix_trans(h2_rn<'*'>(h, s2));
        }
      }
      const uint8_t* vsc = V + record_vt_row(kVB) * D;  // this block's scale per column
#pragma unroll
      for (int md = 0; md < MD; ++md) {
        // Rows 16md + g (+8) of V^T: 4 rows of 32 bytes a half warp (E2M1: 8 rows of 16): no bank conflicts.
        uint32_t a1[4], a2[4];
        if constexpr (kVB == 8) {
          const uint2 lo = *reinterpret_cast<const uint2*>(V + (16 * md + g) * 32 + 8 * t);
          const uint2 hi = *reinterpret_cast<const uint2*>(V + (16 * md + g + 8) * 32 + 8 * t);
          const uint32_t a[4] = {lo.x, hi.x, lo.y, hi.y};  // the m16n8k32 A fragment
          fp8_a_to_f16<false>(a, a1, a2);
        } else {
          uint32_t fl[4], fh[4];
          e2m1x8_to_f16x4(*reinterpret_cast<const uint32_t*>(V + (16 * md + g) * 16 + 4 * t), fl);
          e2m1x8_to_f16x4(*reinterpret_cast<const uint32_t*>(V + (16 * md + g + 8) * 16 + 4 * t), fh);
          a1[0] = fl[0], a1[1] = fh[0], a1[2] = fl[1], a1[3] = fh[1];
          a2[0] = fl[2], a2[1] = fh[2], a2[2] = fl[3], a2[3] = fh[3];
        }
        constexpr float kVUnit = kVB == 8 ? 1.0f / 16384.0f : 1.0f;  // 2^-14 (exact, at worst a float subnormal)
        const float v0 = e8m0_of_byte(vsc[16 * md + g], 0) * kVUnit, v1 = e8m0_of_byte(vsc[16 * md + g + 8], 0) * kVUnit;
#pragma unroll
        for (int nr = 0; nr < kNR; ++nr) {
          float d[4];
          mma_f16_block(d, a1, a2, bq[nr]);
          acc[md][nr][0] += v0 * d[0];
          acc[md][nr][1] += v0 * d[1];
          acc[md][nr][2] += v1 * d[2];
          acc[md][nr][3] += v1 * d[3];
        }
      }
    } else {  // P rounded to bf16 (as the oracle) times bf16 V, 16 keys a step
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t bq[kNR][2];  // P^T: keys 2t, 2t+1 (+8) of row 8nr + g
#pragma unroll
        for (int nr = 0; nr < kNR; ++nr) {
          bq[nr][0] = movmatrix_trans(bf16x2_rn(sc[mt][nr][0], sc[mt][nr][1]));
          bq[nr][1] = movmatrix_trans(bf16x2_rn(sc[mt][nr][2], sc[mt][nr][3]));
        }
        // V^T's A fragments by ldmatrix.trans from V's key rows: matrices (columns +8 for odd,
        // keys +8 for the upper two).
        const int mi = lane / 8, key = 16 * mt + 8 * (mi / 2) + lane % 8;
#pragma unroll
        for (int md = 0; md < MD; ++md) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, V + key * 2 * D + swizzled(D / 8, key, (16 * md + 8 * (mi % 2)) * 2));
#pragma unroll
          for (int nr = 0; nr < kNR; ++nr) mma_16816<true>(acc[md][nr], a, bq[nr][0], bq[nr][1]);
        }
      }
    }
    fill = stage;
    if (++stage == kStages) stage = 0, parity ^= 1u;
  }
  __syncthreads();  // every copy was waited for and every warp is done with the stage buffers: they take the warps' accumulators
  float* sum = reinterpret_cast<float*>(smem);  // [kWarps][kRows][D]
  float* lsum = reinterpret_cast<float*>(smem + S_::kMax);  // [kWarps][kRows]: the maxima's buffers are free too
#pragma unroll
  for (int md = 0; md < MD; ++md)
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sum[(warp * kRows + 8 * nr + 2 * t + i % 2) * D + 16 * md + g + 8 * (i / 2)] = acc[md][nr][i];
  store_rows<kNR>(lsum + warp * kRows, l, kSumOp);
  __syncthreads();
  for (int i = tid; i < rows * D; i += kThreads) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += sum[w * kRows * D + i];
    out_part(i / D)[i % D] = o;
  }
  if (warp == 0 && g == 0)  // m is the same in every warp and lane group
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 8 * nr + 2 * t + r;
        if (row >= rows) continue;
        float lr = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) lr += lsum[w * kRows + row];
        out_part(row)[D] = m[nr][r];
        out_part(row)[D + 1] = lr;
      }
}

// One warp per (row, 32 columns): the splits merged by LSE in one pass over their maxima (the CPU
// oracle folds them pairwise; the two agree to fp32 rounding). Lanes first take the splits' (m, l)
// for the weights, then a column each, its loads over the splits independent of each other (an
// empty split is zeros with m = -inf, weight 0), so they are in flight together.
template <class TOut>
__global__ void merge_splits(const float* part, int64_t rows, int splits, int d, TOut* out, int64_t osb, int64_t osh,
                             int64_t osn, int Hq, int Nq, float scale, float* lse, const float* lse_shift) {
  wait_prior_grids();  // the decode kernel's partials are complete and visible
  const int64_t wid = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32, row = wid / (d / 32);
  const int lane = threadIdx.x % 32, c = int(wid % (d / 32)) * 32 + lane;
  if (row >= rows) return;
  const float* pr = part + row * splits * (d + 2);
  float M = -INFINITY;
  for (int sp = lane; sp < splits; sp += 32) M = fmaxf(M, pr[sp * (d + 2) + d]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  auto weight = [&](int sp) {  // exp(scale (m - M)) of split sp (0 for an empty one; m: raw scores)
    const float m = pr[sp * (d + 2) + d];
    return m == -INFINITY ? 0.0f : expf((m - M) * scale);
  };
  const float w_lane = lane < splits ? weight(lane) : 0.0f;  // the first 32 splits' weights, a lane each
  float lsum = 0.0f;
  for (int sp = lane; sp < splits; sp += 32) lsum += pr[sp * (d + 2) + d + 1] * (sp < 32 ? w_lane : weight(sp));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
  float o = 0.0f;
#pragma unroll 16
  for (int sp = 0; sp < splits; ++sp) o += pr[sp * (d + 2) + c] * (sp < 32 ? __shfl_sync(0xffffffffu, w_lane, sp) : weight(sp));
  const int64_t s = row / (int64_t(Hq) * Nq), h = row / Nq % Hq, r = row % Nq;
  out[s * osb + h * osh + r * osn + c] = from_float<TOut>(o / lsum);
  if (lse && c == 0) lse[row] = M * scale + logf(lsum) + (lse_shift ? lse_shift[row] : 0.0f);  // M in raw score units
}

// The query side of the transforms (QueryTransform), a warp per row, lane l holding channels
// E*l .. E*l + E - 1 (E = D/32): the row rotated in fp32 (rotate_lanes: rotate_row's values), stored
// rounded to bf16 for the decode kernel's quantization; from the rotated fp32 row, the sink keys'
// exact scores and smooth_k's LSE shift, products and sums in fp64 (one rounding to fp32 at the end).
template <int D, class TIn>
__global__ void transform_queries(const TIn* q, int64_t qsb, int64_t qsh, int64_t qsn, int Hq, int Nq, int G,
                                  int64_t rows, QueryTransform qt, PagedKV kv, float scale, uint16_t* qout, float* sink,
                                  float* shift) {
  constexpr int E = D / 32;
  allow_dependents();  // the decode kernel may start its page copies
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t s = row / (int64_t(Hq) * Nq), h = row / Nq % Hq, r = row % Nq, hk = h / G;
  const TIn* src = q + s * qsb + h * qsh + r * qsn + E * lane;
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = to_float(src[e]);
  if (qt.rotate) rotate_lanes(x);
#pragma unroll
  for (int e = 0; e < E; ++e) qout[row * D + E * lane + e] = to_bf16(x[e]).bits;
  // This sequence's state: its first page's, head hk's rows.
  const float* st = qt.state + (int64_t(kv.row(s)[0]) * kv.Hkv + hk) * qt.rows * D;
  auto dot = [&](const float* k) {
    double acc = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) acc += double(x[e]) * k[E * lane + e];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return float(acc);
  };
  if (qt.smooth_k) {
    const float v = dot(st) * scale;
    if (lane == 0) shift[row] = v;
  }
  const float* sk = st + (qt.smooth_k ? D : 0);
  for (int n = 0; n < qt.sink_keys; ++n) {
    const float v = dot(sk + n * D);
    if (lane == 0) sink[row * qt.sink_keys + n] = v;
  }
}

// kCtas CTAs an SM (Smem sizes the stages for it): a block-synchronous kernel measured faster at two
// CTAs than at one CTA with twice the stages, and three faster than two
// for MXFP4 V where the grid fills the GPU (bench/RESULTS.md).
// dependent: launched as the previous kernel's programmatic dependent (the query pre-pass).
template <int D, int kVB, int kNR, int kCtas>
void launch(const Params& p, dim3 grid, cudaStream_t stream, bool dependent) {
  constexpr int bytes = Smem<D, kVB, kNR, kCtas>::kBytes;
  allow_dynamic_smem<decode_kernel<D, kVB, kNR, kCtas>>(bytes);
  launch_kernel(decode_kernel<D, kVB, kNR, kCtas>, grid, dim3(kThreads), bytes, stream, dependent, "decode kernel", p);
}

// One dispatch point for the kernel's instances: head dim x V's bits (16, 8, 4) x rows per CTA (8 or
// 16) x CTAs an SM (three only where three_fit).
void launch(const Params& p, dim3 grid, int d, int vbits, int nr, int ctas, cudaStream_t stream, bool dependent) {
  auto go = [&](auto dc, auto vc) {
    constexpr int D = decltype(dc)::value, kVB = decltype(vc)::value;
    if (nr == 1) {
      if constexpr (max_ctas(kVB, 1) >= 4)
        if (ctas == 4) return launch<D, kVB, 1, 4>(p, grid, stream, dependent);
      if constexpr (max_ctas(kVB, 1) >= 3)
        if (ctas == 3) return launch<D, kVB, 1, 3>(p, grid, stream, dependent);
      launch<D, kVB, 1, 2>(p, grid, stream, dependent);
    } else {
      launch<D, kVB, 2, 2>(p, grid, stream, dependent);
    }
  };
  auto with_v = [&](auto dc) {
    if (vbits == 16)
      go(dc, std::integral_constant<int, 16>{});
    else if (vbits == 8)
      go(dc, std::integral_constant<int, 8>{});
    else
      go(dc, std::integral_constant<int, 4>{});
  };
  with_head_dim(d, "the CUDA decode", with_v);
}

}  // namespace

void decode_paged_async(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                        float scale, int splits, int* nonfinite, cudaStream_t stream, const QueryTransform& qt,
                        int64_t window_left) {
  const int64_t S = kv.S, Hkv = kv.Hkv, d = kv.d, Hq = q.shape[1], Nq = q.shape[2];
  require(cuda_decode_capabilities(), policy, d);
  if (q.device != Device::cuda || out.device != Device::cuda) throw Error("decode: q and out must be CUDA tensors");
  if (q.stride[3] != 1 || out.stride[3] != 1) throw Error("the CUDA decode needs unit stride on the head dimension");
  if (q.shape[0] != S || q.shape[3] != d || Hq % Hkv != 0 || out.shape != q.shape)
    throw Error("decode: q and out must be [S, a multiple of Hkv, Nq, d]");
  const int vbits = v_bits(policy.pv);
  if (!kv.rec || kv.vbits != vbits) throw Error("decode: the pages' records do not hold V in the policy's pv format");
  if (Hkv * (kTile / kRecordKeys) * record_bytes(int(d), vbits) >= (int64_t(1) << 32))
    throw Error("decode: a page's records exceed 4 GiB (too many KV heads)");
  const Format fmt[2] = {policy.high, policy.low};
  Params p{};
  p.kv = kv;
  p.Hq = int(Hq);
  p.Nq = int(Nq);
  p.G = int(Hq / Hkv);
  // Rows per CTA: 8 (one N tile of the mma) when the GQA group's rows fit, else 16 and more chunks.
  const int nr = p.G * p.Nq <= 8 ? 1 : 2;
  p.chunks = (p.G * p.Nq + 8 * nr - 1) / (8 * nr);
  p.rule = policy.scale_rule;
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  // DMATTN_DECODE_CTAS=2|3|4 forces the instance (capped at what it fits; the GPU tests run each).
  const char* force = std::getenv("DMATTN_DECODE_CTAS");
  // A sliding window runs at two CTAs an SM (kWindow).
  const int only = window_left >= 0 ? 2 : force && (force[0] >= '2' && force[0] <= '4') ? force[0] - '0' : 0;
  // A sliding window bounds the pages a sequence reads: its Nq rows' windows span at most this many.
  p.window_left = int(window_left < 0 ? INT32_MAX : std::min<int64_t>(window_left, INT32_MAX));
  const int pages = int(std::min<int64_t>(kv.max_pages, (int64_t(p.window_left) + Nq - 1) / kTile + 2));
  const DecodePlan plan = decode_plan(S * Hkv * p.chunks, pages, sms, max_ctas(vbits, nr), splits, only);
  p.splits = std::min(plan.splits, std::max(1, kv.max_pages));
  Buffers buf(stream);  // stream-ordered: freed after the enqueued work
  const int64_t rows = S * Hq * Nq;
  p.q = q.data;
  p.qdt = q.dtype;
  p.qsb = q.stride[0];
  p.qsh = q.stride[1];
  p.qsn = q.stride[2];
  float* lse_shift = nullptr;
  if (qt.on) {
    // The rotation multiplies every score by its block size: the scale divides it out (exactly).
    if (qt.rotate) scale /= float(rotation_block(int(d)));
    // One scratch allocation: the transformed q (bf16), the sink scores, the LSE shifts.
    const size_t qx_bytes = (size_t(rows * d) * sizeof(uint16_t) + 15) / 16 * 16;
    const size_t sink_floats = size_t(rows * qt.sink_keys), shift_floats = qt.smooth_k ? size_t(rows) : 0;
    uint8_t* scratch = buf.alloc<uint8_t>(qx_bytes + (sink_floats + shift_floats) * sizeof(float));
    uint16_t* qx = reinterpret_cast<uint16_t*>(scratch);
    float* sink = sink_floats ? reinterpret_cast<float*>(scratch + qx_bytes) : nullptr;
    lse_shift = shift_floats ? reinterpret_cast<float*>(scratch + qx_bytes) + sink_floats : nullptr;
    if ((qt.smooth_k || qt.sink_keys > 0) && !qt.state) throw Error("decode: the transforms' state is missing");
    const unsigned blocks = unsigned((rows + 3) / 4);  // four warps a block, a warp a row
    with_typed(q, [&](auto* typed) {
      auto go = [&](auto dc) {
        transform_queries<decltype(dc)::value><<<blocks, 128, 0, stream>>>(
            typed, q.stride[0], q.stride[1], q.stride[2], int(Hq), int(Nq), p.G, rows, qt, kv, scale, qx, sink, lse_shift);
      };
      with_head_dim(d, "the CUDA decode", go);
    });
    check(cudaGetLastError(), "decode query transform");
    p.q = qx;
    p.qdt = DType::bf16;
    p.qsn = d;
    p.qsh = Nq * d;
    p.qsb = Hq * Nq * d;
    p.sink = sink;
    p.sink_keys = qt.sink_keys;
  }
  p.nonfinite = nonfinite;
  for (int sl = 0; sl < 2; ++sl) p.kelem[sl] = format_info(fmt[sl]).elem;
  p.scale = float(double(scale) * 1.4426950408889634);  // base 2 in the kernel, the product rounded once
  p.part = buf.alloc<float>(size_t(rows * p.splits * (d + 2)) * sizeof(float));
  const dim3 grid(unsigned(p.splits), unsigned(Hkv * p.chunks), unsigned(S));
  launch(p, grid, int(d), vbits, nr, plan.ctas_per_sm, stream, qt.on);
  check(cudaGetLastError(), "decode kernel");
  const unsigned mblocks = unsigned((rows * (d / 32) + 7) / 8);  // 8 warps a block, a warp per 32 columns of a row
  // Launched as the decode kernel's programmatic dependent: its CTAs are placed while the decode
  // finishes (the decode triggers at its start; merge_splits waits for the decode grid's completion).
  with_typed(out, [&](auto* typed) {
    launch_kernel(merge_splits<std::remove_pointer_t<decltype(typed)>>, dim3(mblocks), dim3(256), 0, stream, true,
                  "merge kernel", static_cast<const float*>(p.part), rows, p.splits, int(d), typed, out.stride[0],
                  out.stride[1], out.stride[2], int(Hq), int(Nq), scale, lse, static_cast<const float*>(lse_shift));
  });
}

void decode_paged(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                  float scale, int splits, cudaStream_t stream, const QueryTransform& qt, int64_t window_left) {
  Buffers buf(stream);
  int* bad = buf.alloc<int>(sizeof(int));
  check(cudaMemsetAsync(bad, 0, sizeof(int), stream), "cudaMemset");
  decode_paged_async(kv, policy, q, out, lse, scale, splits, bad, stream, qt, window_left);
  int bad_host = 0;
  check(cudaMemcpyAsync(&bad_host, bad, sizeof bad_host, cudaMemcpyDeviceToHost, stream), "decode");
  check(cudaStreamSynchronize(stream), "decode");
  if (bad_host) throw Error("decode_attention: q holds a non-finite value");
}

}  // namespace dmattn::cuda
