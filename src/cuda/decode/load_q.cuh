// The decode's prologue: the CTA's query rows quantized in both format slots, as the codec's
// quantize_mx_block (the CPU decode's rule; a CTA's rows are a few KB, so no separate pass or launch),
// into the B fragments of S^T's mma (scores.cuh) and their block scales in shared memory.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/common/rotate_lanes.cuh"
#include "cuda/decode/pages.cuh"
#include "cuda/decode/scores.cuh"
#include "cuda/ptx/fp8.cuh"
#include "cuda/ptx/pdl.cuh"
#include "cuda/ptx/tma.cuh"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda::decode {

// Rows r0 .. r0 + rows - 1 of KV head hk's G x Nq of sequence s (their q rows are consecutive); rows
// past them get zero codes and scales. Waits for the prior grid (the transforms' query pre-pass) before
// its first read of q, after the pages' first copies were issued. With p.rotate_q, each row is first
// rotated as the pre-pass would, a warp a row (rotate_lanes, then rounded to bf16): the rotation needs
// no launch of its own. Leaves qb, sq and the FP6 lut (Smem) written and visible to the CTA,
// and the last stage buffer (q's bytes on the way) free for copies.
template <int D, int kVB, int kNR, int kCtas>
__device__ __forceinline__ void load_q(const Params& p, const PageStream<D, kVB, kNR, kCtas>& pages, int s, int hk, int r0,
                                       int rows) {
  using S_ = Smem<D, kVB, kNR, kCtas>;
  constexpr int NB = D / 32, kStages = S_::kStages, kRows = S_::kRows;
  uint8_t* smem = pages.smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint8_t* lut = smem + S_::kLut;
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
  // The stage buffer the codes go to (below) first takes the rotated rows, after the codes' room.
  uint8_t* q8 = pages.buffer(kStages - 1) - warp * S_::kWarpStage;  // [slot][kRows][D] bytes
  float* qrot = reinterpret_cast<float*>(q8 + 2 * kRows * D);        // [kRows][D] (rotate_q)
  static_assert(2 * kRows * D + 4 * kRows * D <= kWarps * S_::kWarpStage);
  if (p.rotate_q) {
    constexpr int E = D / 32;
    for (int r = warp; r < rows; r += kWarps) {  // uniform across the warp (the shuffle)
      const int64_t off = __shfl_sync(0xffffffffu, row_off, r) + E * lane;
      float x[E];
#pragma unroll
      for (int e = 0; e < E; ++e)
        x[e] = q32 ? static_cast<const float*>(p.q)[off + e]
                   : p.qdt == DType::f16 ? to_float(static_cast<const fp16*>(p.q)[off + e])
                                         : to_float(static_cast<const bf16*>(p.q)[off + e]);
      rotate_lanes(x);
#pragma unroll
      for (int e = 0; e < E; ++e) qrot[r * D + E * lane + e] = round_bf16(x[e]);
    }
    __syncthreads();
  }
  uint32_t qraw[kJobs];  // f32 bits, or a 16-bit value's in the low half
#pragma unroll
  for (int i = 0; i < kJobs; ++i) {
    const int it = warp + i * kWarps;  // uniform across the warp (the shuffle below)
    qraw[i] = 0;
    if (it < rows * NB && !p.rotate_q) {
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
    const float v = p.rotate_q ? qrot[r * D + c * 32 + lane]
                    : q32      ? __uint_as_float(qraw[i])
                    : p.qdt == DType::f16 ? to_float(fp16{h}) : to_float(bf16{h});
    const bool bad = __any_sync(0xffffffffu, !hd::is_finite(v));
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0 && bad && p.nonfinite) *p.nonfinite = 1;
#pragma unroll 1
    for (int sl = 0; sl < 2; ++sl) {  // rolled: the encoders' branches twice over would double the code
      const Elem e = pages.elem_of(sl);
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
}

}  // namespace dmattn::cuda::decode
