// The decode kernel's shapes and parameters: a page of kTile keys, four warps a CTA (a warp a 32-key
// block of every page), the CTAs an SM an instance fits, and what the host passes (Params).
#pragma once
#include <cstdint>

#include "cuda/decode/decode.cuh"
#include "dmattn/format.hpp"
#include "dmattn/policy.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn::cuda::decode {

constexpr int T = kTile;          // keys per page
constexpr int kWarps = T / 32;    // warp w owns keys 32w..32w+31 of every page: one MX block of P
constexpr int kThreads = 32 * kWarps;
// CTAs an SM (kCtas); registers and shared memory are sized for it. The kernel is latency-bound, so
// more warps an SM help where the grid fills the GPU (decode_plan weighs that against waves). Most an
// instance fits: with 8-row CTAs, four where V is MXFP4 (127 registers, two stages a warp), three where
// it is MXFP8 (two stages); two for bf16 V (twice the stage bytes) and 16-row CTAs (~200 registers).
// At d = 256 a record is twice d = 128's: two stages a warp leave room for two CTAs with MXFP4 V, one
// with MXFP8 or bf16 V.
constexpr int max_ctas(int d, int vbits, int nr) {
  if (d > 128) return vbits == 4 ? 2 : 1;
  return nr == 1 ? (vbits == 4 ? 4 : vbits == 8 ? 3 : 2) : 2;
}

struct Params {
  PagedKV kv;
  const void* q;         // [S, Hq, Nq, d] f32 / f16 / bf16, unit stride on d: quantized by each CTA
  DType qdt;
  int64_t qsb, qsh, qsn;
  bool rotate_q;         // rotate each q row, then round it to bf16 (the transforms' query side, no pre-pass)
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

// Calls f(x, key, row) for each of this thread's scores x of page j (S^T's accumulators, s[mt][nr][i]:
// key 16mt + g + 8(i/2) of warp w's 32, absolute key j*T + 32w + that, row 8nr + 2t + i%2).
template <int kNR, class F>
__device__ __forceinline__ void for_each_score(float (&s)[2][kNR][4], int j, F&& f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kbase = j * T + 32 * (threadIdx.x / 32) + g;
#pragma unroll
  for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) f(s[mt][nr][i], kbase + 16 * mt + 8 * (i / 2), 8 * nr + 2 * t + i % 2);
}

}  // namespace dmattn::cuda::decode
