// The mask in the decode kernel (src/core/mask.hpp states it): causal with bottom-right alignment
// (a sequence's Nq new queries are its last Nq positions) and an optional left window, per thread
// for its rows 8nr + 2t + r, and which pages of a sequence the rows' windows reach.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/decode/params.cuh"

namespace dmattn::cuda::decode {

// The pages [first, L / T rounded up) that hold a key some row of a sequence of L keys sees: with a
// window, page `first` is the first the earliest row's window (position L - Nq) reaches.
template <bool kWindow>
__device__ __forceinline__ int first_page(int L, int Nq, int window_left) {
  return kWindow ? max(0, L - Nq - window_left) / T : 0;
}

// kWindow: sliding windows (Params::window_left) are compiled in; else causal only.
template <int kNR, bool kWindow>
struct RowMask {
  int kend[kNR][2];  // the last key (exclusive, absolute) each of the thread's rows sees
  int whole0;        // kWindow: pages from whole0 on start inside the last row's window
  const Params& p;   // Nq, window_left
  int L;

  // A sequence of L keys; rows: the CTA's real rows (r0 the first, of the KV head's G x Nq); rows past
  // them see every key.
  __device__ __forceinline__ RowMask(const Params& p_, int L_, int r0, int rows) : p(p_), L(L_) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 8 * nr + 2 * t + r;
        kend[nr][r] = row < rows ? L - p.Nq + (r0 + row) % p.Nq + 1 : L;
      }
    whole0 = kWindow ? max(0, L - 1 - p.window_left + T - 1) / T : 0;
  }

  // Masks page j's scores s (s[mt][nr][i]: key 16mt + g + 8(i/2) of warp w's 32, row 8nr + 2t + i%2):
  // a key a row does not see scores -inf. A row sees key k where 0 <= kend - 1 - k <= window_left
  // (one unsigned compare), or, causal only, k < kend. Pages every row sees whole are left alone.
  __device__ __forceinline__ void apply(float (&s)[2][kNR][4], int j) const {
    const bool whole = (j + 1) * T <= L - p.Nq + 1 && (!kWindow || j >= whole0);
    if (whole) return;
    for_each_score<kNR>(s, j, [&](float& x, int key, int row) {
      const int end = kend[row / 8][row % 2];
      if (kWindow ? uint32_t(end - 1 - key) > uint32_t(p.window_left) : key >= end) x = -INFINITY;
    });
  }
};

}  // namespace dmattn::cuda::decode
