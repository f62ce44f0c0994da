// The accuracy transforms' pre-pass (transform.hpp). A warp holds a row of d = 32 E channels, E
// contiguous channels a lane (lane E + e), so the Hadamard butterfly's stages below E are register
// pairs and the rest lane shuffles: the same additions in the same stages as rotate_row on the host,
// so rotated rows are bit-identical. Means and dots accumulate in fp64 and round once to fp32.
#include <algorithm>
#include <type_traits>

#include "cuda/common/buffers.hpp"
#include "cuda/common/rotate_lanes.cuh"
#include "cuda/prepass/transform.hpp"
#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/policy.hpp"
#include "dmattn/rotation.hpp"

namespace dmattn::cuda {
namespace {

// Warps a CTA of the row kernels: enough rows in flight to cover a row's load latency (a warp takes
// its rows one after another).
constexpr int kWarps = 16, kRowThreads = 32 * kWarps;

// Row n of a [B, H, N, d] view into this lane's channels lane E + e, as fp32, rotated. vec: unit
// stride along d and rows aligned to E elements, so a lane's channels are one vector load.
template <class T, int E>
__device__ __forceinline__ void load_row(const TensorView& v, int64_t b, int64_t h, int64_t n, bool vec, bool rotate,
                                         float (&r)[E]) {
  const int lane = threadIdx.x % 32;
  const T* row = static_cast<const T*>(v.data) + b * v.stride[0] + h * v.stride[1] + n * v.stride[2];
  if (vec) {
    load_lane<E>(row + lane * E, true, r);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) r[e] = to_float(row[(lane * E + e) * v.stride[3]]);
  }
  if (rotate) rotate_lanes(r);
}

// This lane's E channels as bf16 into a row of d (E 16-bit values, one store).
template <int E>
__device__ __forceinline__ void store_bf16(uint16_t* row, const float (&x)[E]) {
  uint16_t h[E];
#pragma unroll
  for (int e = 0; e < E; ++e) h[e] = to_bf16(x[e]).bits;
  const int lane = threadIdx.x % 32;
  if constexpr (E == 1)
    row[lane] = h[0];
  else if constexpr (E == 2)
    *reinterpret_cast<uint32_t*>(row + 2 * lane) = *reinterpret_cast<const uint32_t*>(h);
  else if constexpr (E == 4)
    *reinterpret_cast<uint2*>(row + 4 * lane) = *reinterpret_cast<const uint2*>(h);
  else
    *reinterpret_cast<uint4*>(row + 8 * lane) = *reinterpret_cast<const uint4*>(h);
}

// sum over the row of a[c] * b[c] in fp64, the same value in every lane.
template <int E>
__device__ __forceinline__ double warp_dot(const float (&a)[E], const float (&b)[E]) {
  double s = 0;
#pragma unroll
  for (int e = 0; e < E; ++e) s += double(a[e]) * b[e];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

template <int E>
__device__ __forceinline__ void load_bf16_row(const uint16_t* row, float (&r)[E]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int e = 0; e < E; ++e) r[e] = to_float(bf16{row[lane * E + e]});
}

// Rows of x ([B, H, N, d]) rotated, minus sub[b*H + h] where given (smooth_k's mean), to bf16 (out),
// or into each 128-row chunk's channel sums (part, fp64): K's transformed rows, and the means of K
// (smooth_k) and Q (smooth_q). Grid: (chunks, B * H); kWarps warps. slot_row (packed sequences, sums
// only): chunk c sums the rows slot_row[128 c ..] names (-1: padding), a sequence's keys in the
// order of its own chunks (kSlots: an instance of its own).
template <class T, int E, bool kSlots = false>
__global__ void __launch_bounds__(kRowThreads) rows_kernel(TensorView x, bool vec, bool rotate, const float* sub,
                                                           uint16_t* out, double* part, const int32_t* slot_row) {
  constexpr int d = 32 * E;
  const int64_t bh = blockIdx.y, b = bh / x.shape[1], h = bh % x.shape[1], N = x.shape[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ double sums[kWarps][d];
  double acc[E] = {};
  float m[E] = {};
  if (sub)
#pragma unroll
    for (int e = 0; e < E; ++e) m[e] = sub[bh * d + lane * E + e];
  const int64_t n0 = int64_t(blockIdx.x) * 128 + warp, n1 = min(N, int64_t(blockIdx.x + 1) * 128);
  if (out) {
    for (int64_t n = n0; n < n1; n += kWarps) {
      float r[E];
      load_row<T, E>(x, b, h, n, vec, rotate, r);
#pragma unroll
      for (int e = 0; e < E; ++e) r[e] -= m[e];
      store_bf16<E>(out + (bh * N + n) * d, r);
    }
    return;
  }
  const int64_t end = kSlots ? int64_t(blockIdx.x + 1) * 128 : n1;
  for (int64_t n = n0; n < end; n += kWarps) {
    const int64_t row = kSlots ? slot_row[n] : n;
    if (kSlots && row < 0) continue;  // padding (uniform across the warp)
    float r[E];
    load_row<T, E>(x, b, h, row, vec, rotate, r);
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] += r[e];
  }
  // Rows n = warp (mod kWarps) summed per warp: the chunk's sum then adds the warps' in a fixed order.
#pragma unroll
  for (int e = 0; e < E; ++e) sums[warp][lane * E + e] = acc[e];
  __syncthreads();
  for (int c = threadIdx.x; c < d; c += kRowThreads) {
    double s = 0;
    for (int w = 0; w < kWarps; ++w) s += sums[w][c];
    part[(bh * gridDim.x + blockIdx.x) * d + c] = s;
  }
}

// The same chunk sums as rows_kernel's without the rotation, for rows of 16-bit values that lie
// back to back (stride d) from a 16-byte aligned start: a thread a 16-byte load of 8 channels a row,
// its 128 / kRows rows loaded together, so the read runs near copy bandwidth. Grid: (chunks, B * H).
template <class T, int E>
__global__ void __launch_bounds__(256) chunk_sums_kernel(TensorView x, double* part) {
  constexpr int d = 32 * E, kLanes = d / 8, kRows = 256 / kLanes, kIters = 128 / kRows;
  const int64_t bh = blockIdx.y, b = bh / x.shape[1], h = bh % x.shape[1], N = x.shape[2];
  const int c0 = (threadIdx.x % kLanes) * 8, r0 = threadIdx.x / kLanes;
  const T* base = static_cast<const T*>(x.data) + b * x.stride[0] + h * x.stride[1];
  __shared__ double sums[kRows][d];
  uint4 w[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int64_t n = int64_t(blockIdx.x) * 128 + r0 + i * kRows;
    w[i] = n < N ? *reinterpret_cast<const uint4*>(base + n * d + c0) : make_uint4(0, 0, 0, 0);
  }
  double acc[8] = {};
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const uint16_t* h16 = reinterpret_cast<const uint16_t*>(&w[i]);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += to_float(T{h16[e]});
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) sums[r0][c0 + e] = acc[e];
  __syncthreads();
  for (int c = threadIdx.x; c < d; c += 256) {
    double t = 0;
    for (int r = 0; r < kRows; ++r) t += sums[r][c];
    part[(bh * gridDim.x + blockIdx.x) * d + c] = t;
  }
}

// mean = (sum of the chunks' sums) / N, then rotated where `rotate` (the mean of the rows as read,
// carried to the rotated frame: smooth_q's); grid B * H, a thread a channel (d threads), then one
// warp rotates (lane channels lane E + e). Packed sequences (seqs): grid nseq * H, sequence i's mean
// of head h from its own chunks (tile0 ..) of part [H][chunks][d], into mean[i * H + h] (kSeqs).
template <int E, bool kSeqs = false>
__global__ void mean_kernel(const double* part, int chunks, int64_t N, bool rotate, float* mean, const SeqSpan* seqs,
                            int heads) {
  constexpr int d = 32 * E;
  __shared__ float m[d];
  const int c = threadIdx.x;
  double s = 0;
  if constexpr (kSeqs) {
    const SeqSpan q = seqs[blockIdx.x / heads];
    const int64_t first = int64_t(blockIdx.x % heads) * chunks + q.tile0, count = (q.nk + 127) / 128;
    for (int64_t i = 0; i < count; ++i) s += part[(first + i) * d + c];
    N = q.nk > 0 ? q.nk : 1;  // (a sequence without keys: its mean is never read)
  } else {
    for (int i = 0; i < chunks; ++i) s += part[(int64_t(blockIdx.x) * chunks + i) * d + c];
  }
  m[c] = float(s / double(N));
  if (!rotate) {
    mean[int64_t(blockIdx.x) * d + c] = m[c];
    return;
  }
  __syncthreads();
  if (c >= 32) return;
  float r[E];
#pragma unroll
  for (int e = 0; e < E; ++e) r[e] = m[c * E + e];
  rotate_lanes(r);
#pragma unroll
  for (int e = 0; e < E; ++e) mean[int64_t(blockIdx.x) * d + c * E + e] = r[e];
}

// smooth_q's correction ds[b*Hq + h][n] = scale * mu(h).k'[n], k' key n as the quantize pass takes it
// (rotated, minus kmean where given, rounded to bf16), for every query head of the key's group; 0 for
// n in [Nk, ldv). A warp takes 8 keys, the G dots of each in fp64 (the oracle's dot_f64). Grid: (ldv / 128, B * Hkv).
template <class T, int E>
__global__ void __launch_bounds__(kRowThreads) key_dots_kernel(TensorView k, bool vec, bool rotate, const float* kmean,
                                                               const float* qmean, int G, float scale, int64_t ldv,
                                                               float* ds) {
  constexpr int d = 32 * E;
  const int64_t bh = blockIdx.y, b = bh / k.shape[1], h = bh % k.shape[1], N = k.shape[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float m[E] = {};
  if (kmean)
#pragma unroll
    for (int e = 0; e < E; ++e) m[e] = kmean[bh * d + lane * E + e];
  const int64_t bhq0 = (b * k.shape[1] + h) * G;  // the group's first query head
  // The warp's keys all loaded before the first dot, so their loads are in flight together.
  constexpr int kPerWarp = 128 / kWarps;
  const int64_t n0 = int64_t(blockIdx.x) * 128 + warp;
  float r[kPerWarp][E];
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i)
    if (n0 + i * kWarps < N) load_row<T, E>(k, b, h, n0 + i * kWarps, vec, rotate, r[i]);
  for (int g = 0; g < G; ++g) {
    float mu[E];
#pragma unroll
    for (int e = 0; e < E; ++e) mu[e] = qmean[(bhq0 + g) * d + lane * E + e];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int64_t n = n0 + i * kWarps;
      float y[E];
#pragma unroll
      for (int e = 0; e < E; ++e) y[e] = to_float(to_bf16(r[i][e] - m[e]));
      const double s = n < N ? warp_dot<E>(mu, y) : 0.0;
      if (lane == 0) ds[(bhq0 + g) * ldv + n] = float(s) * scale;
    }
  }
}

struct QArgs {
  TensorView q;
  bool vec, rotate;
  int64_t Hkv, Nk, q_pos0, qtile0;  // q_pos0: row 0's position from key 0
  float scale;
  const uint16_t* k;   // transformed K [B, Hkv, Nk, d] (the sink scores)
  const float* kmean;  // smooth_k with an LSE: [B*Hkv, d] (the LSE shift), else null
  const float* qmean;  // smooth_q: [B*Hq, d], subtracted from the rows written to out; else null
  int sink;
  uint16_t* out;
  uint16_t* out_plain;  // smooth_q=high: the rows not centred (the low tiles'), else null
  float *lse_shift, *sinks;
  const int32_t* row_seq = nullptr;  // packed sequences: each row's sequence (kmean [nseq * Hkv][d])
};

// One query tile's rows of one (b, h): rotated; the exact sink scores and the LSE shift from the
// rotated rows; then minus the head's mean (smooth_q) to bf16, and (smooth_q=high) as they are to bf16
// too. Grid (qtiles, Hq, B); kWarps warps.
template <class T, int E, bool kSeq = false>
__global__ void __launch_bounds__(kRowThreads) q_rows_kernel(QArgs a) {
  constexpr int d = 32 * E;
  const int64_t b = blockIdx.z, h = blockIdx.y, c = blockIdx.x, Nq = a.q.shape[2], Hq = a.q.shape[1];
  const int64_t hk = h / (Hq / a.Hkv), bhq = b * Hq + h, kv_head = (b * a.Hkv + hk) * a.Nk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = max(int64_t(0), (a.qtile0 + c) * 128 - a.q_pos0), r1 = min(Nq, (a.qtile0 + c + 1) * 128 - a.q_pos0);
  float km[E], mu[E] = {};
  if (a.kmean)
#pragma unroll
    for (int e = 0; e < E; ++e) km[e] = a.kmean[(b * a.Hkv + hk) * d + lane * E + e];
  if (a.qmean)
#pragma unroll
    for (int e = 0; e < E; ++e) mu[e] = a.qmean[bhq * d + lane * E + e];
  for (int64_t r = r0 + warp; r < r1; r += kWarps) {
    float x[E];
    load_row<T, E>(a.q, b, h, r, a.vec, a.rotate, x);
    const int64_t row = bhq * Nq + r;
    for (int n = 0; n < a.sink; ++n) {
      float kv[E];
      load_bf16_row<E>(a.k + (kv_head + n) * d, kv);
      const double s = warp_dot<E>(x, kv);
      if (lane == 0) a.sinks[row * a.sink + n] = float(s) * a.scale;
    }
    if (a.kmean) {
      if constexpr (kSeq)
#pragma unroll
        for (int e = 0; e < E; ++e) km[e] = a.kmean[(a.row_seq[r] * a.Hkv + hk) * d + lane * E + e];
      const double s = warp_dot<E>(x, km);
      if (lane == 0) a.lse_shift[row] = float(s) * a.scale;
    }
    if (a.out_plain) store_bf16<E>(a.out_plain + row * d, x);
    if (a.out) {
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] -= mu[e];
      store_bf16<E>(a.out + row * d, x);
    }
  }
}

__global__ void lse_shift_kernel(float* lse, const float* shift, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    lse[i] += shift[i];
}

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + 255) / 256, 132 * 16)); }

// The channel means of x's rows (H = x.shape[1], N = x.shape[2]), in the rotated frame where
// `rotate`: of the rotated rows (rows_first, smooth_k's), or of the rows as read, then rotated
// (smooth_q's: the same vector in real arithmetic, without a butterfly per row). part [B*H][chunks][d]
// scratch, mean [B*H][d]. Packed sequences (pk, keys): chunks are the padded key tiles, and each
// sequence's means go to mean [nseq * H][d].
template <int E>
void row_means_d(const TensorView& x, bool rotate, bool rows_first, double* part, float* mean, cudaStream_t stream,
                 const PackedMaps* pk = nullptr) {
  const int64_t BH = x.shape[0] * x.shape[1], N = x.shape[2], chunks = pk ? pk->ldv / kTile : (N + kTile - 1) / kTile;
  const bool back_to_back = dtype_size(x.dtype) == 2 && x.stride[3] == 1 && x.stride[2] == 32 * E &&
                            reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride[0] % 8 == 0 && x.stride[1] % 8 == 0;
  with_typed(x, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    if constexpr (sizeof(T) == 2)
      if (back_to_back && !(rotate && rows_first) && !pk) {
        chunk_sums_kernel<T, E><<<dim3(unsigned(chunks), unsigned(BH)), 256, 0, stream>>>(x, part);
        return;
      }
    const dim3 grid{unsigned(chunks), unsigned(BH)};
    if (pk)
      rows_kernel<T, E, true><<<grid, kRowThreads, 0, stream>>>(x, vector_rows(x, E), rotate && rows_first, nullptr,
                                                                nullptr, part, pk->slot_key);
    else
      rows_kernel<T, E><<<grid, kRowThreads, 0, stream>>>(x, vector_rows(x, E), rotate && rows_first, nullptr, nullptr,
                                                          part, nullptr);
  });
  check(cudaGetLastError(), "row sums");
  if (pk)
    mean_kernel<E, true><<<unsigned(int64_t(pk->nseq) * x.shape[1]), 32 * E, 0, stream>>>(
        part, int(chunks), N, rotate && !rows_first, mean, pk->seqs, int(x.shape[1]));
  else
    mean_kernel<E><<<unsigned(BH), 32 * E, 0, stream>>>(part, int(chunks), N, rotate && !rows_first, mean, nullptr, 0);
  check(cudaGetLastError(), "mean_kernel");
}

template <int E>
void key_dots_d(const Problem& p, const float* kmean, const float* qmean, float scale, float* ds, cudaStream_t stream) {
  const int64_t chunks = (p.Nk + kTile - 1) / kTile;
  with_typed(p.k, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    key_dots_kernel<T, E><<<dim3(unsigned(chunks), unsigned(p.B * p.Hkv)), kRowThreads, 0, stream>>>(
        p.k, vector_rows(p.k, E), p.policy.rotate, kmean, qmean, int(p.group()), scale, chunks * kTile, ds);
  });
  check(cudaGetLastError(), "key_dots_kernel");
}

template <int E>
void transform_d(const Problem& p, const Transformed& t, float scale, cudaStream_t stream) {
  const Policy& pol = p.policy;
  const int64_t chunks = (p.Nk + kTile - 1) / kTile;
  if (pol.smooth_k) row_means_d<E>(p.k, pol.rotate, true, t.k_part, t.kmean, stream);
  if (t.qmean) row_means_d<E>(p.q, pol.rotate, false, t.q_part, t.qmean, stream);
  with_typed(p.k, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    rows_kernel<T, E><<<dim3(unsigned(chunks), unsigned(p.B * p.Hkv)), kRowThreads, 0, stream>>>(
        p.k, vector_rows(p.k, E), pol.rotate, pol.smooth_k ? t.kmean : nullptr, t.k, nullptr, nullptr);
  });
  check(cudaGetLastError(), "rows_kernel");
  QArgs a{p.q,   vector_rows(p.q, E), pol.rotate, p.Hkv, p.Nk, p.q_pos0 - p.k_pos0, t.qtile0, scale, t.k,
          t.lse_shift ? t.kmean : nullptr, t.qmean, t.sink_keys, t.q, t.q_plain, t.lse_shift, t.sink};
  with_typed(p.q, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    q_rows_kernel<T, E><<<dim3(unsigned(t.qtiles), unsigned(p.Hq), unsigned(p.B)), kRowThreads, 0, stream>>>(a);
  });
  check(cudaGetLastError(), "q_rows_kernel");
  if (t.qmean) key_dots_d<E>(p, pol.smooth_k ? t.kmean : nullptr, t.qmean, scale, t.ds, stream);
}

template <class F>
void by_head_dim(int64_t d, F&& f) {
  switch (d) {
    case 32: return f(std::integral_constant<int, 1>{});
    case 64: return f(std::integral_constant<int, 2>{});
    case 128: return f(std::integral_constant<int, 4>{});
    case 256: return f(std::integral_constant<int, 8>{});
    default: throw Error("the accuracy transforms on the GPU take head dims 32, 64, 128 and 256 (got " + std::to_string(d) + ")");
  }
}

}  // namespace

void query_tiles(const Problem& p, int64_t& first, int64_t& count) {
  const int64_t pos0 = p.q_pos0 - p.k_pos0;
  first = hd::floor_div(pos0, kTile);
  count = hd::floor_div(pos0 + p.Nq - 1, kTile) - first + 1;
}

void transform_qk(const Problem& p, const Transformed& t, float scale, cudaStream_t stream) {
  by_head_dim(p.d, [&](auto e) { transform_d<decltype(e)::value>(p, t, scale, stream); });
}

template <int E>
void lse_shifts_d(const Problem& p, const float* kmean, float scale, int64_t qtile0, int64_t qtiles, float* shift,
                  cudaStream_t stream, const int32_t* row_seq) {
  QArgs a{p.q,   vector_rows(p.q, E), p.policy.rotate, p.Hkv, p.Nk, p.q_pos0 - p.k_pos0, qtile0, scale, nullptr,
          kmean, nullptr, 0, nullptr, nullptr, shift, nullptr, row_seq};
  with_typed(p.q, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    const dim3 grid{unsigned(qtiles), unsigned(p.Hq), unsigned(p.B)};
    if (row_seq)
      q_rows_kernel<T, E, true><<<grid, kRowThreads, 0, stream>>>(a);
    else
      q_rows_kernel<T, E><<<grid, kRowThreads, 0, stream>>>(a);
  });
  check(cudaGetLastError(), "q_rows_kernel");
}

void key_means(const Problem& p, double* part, float* kmean, cudaStream_t stream, const PackedMaps* pk) {
  by_head_dim(p.d, [&](auto e) { row_means_d<decltype(e)::value>(p.k, p.policy.rotate, true, part, kmean, stream, pk); });
}

void query_means(const Problem& p, double* part, float* qmean, cudaStream_t stream) {
  by_head_dim(p.d, [&](auto e) { row_means_d<decltype(e)::value>(p.q, p.policy.rotate, false, part, qmean, stream); });
}

void key_dots(const Problem& p, const float* kmean, const float* qmean, float scale, float* ds, cudaStream_t stream) {
  by_head_dim(p.d, [&](auto e) { key_dots_d<decltype(e)::value>(p, kmean, qmean, scale, ds, stream); });
}

void lse_shifts(const Problem& p, const float* kmean, float scale, int64_t qtile0, int64_t qtiles, float* shift,
                cudaStream_t stream, const int32_t* row_seq) {
  by_head_dim(p.d,
              [&](auto e) { lse_shifts_d<decltype(e)::value>(p, kmean, scale, qtile0, qtiles, shift, stream, row_seq); });
}

void add_lse_shift(float* lse, const float* shift, int64_t n, cudaStream_t stream) {
  lse_shift_kernel<<<grid_for(n), 256, 0, stream>>>(lse, shift, n);
  check(cudaGetLastError(), "lse_shift_kernel");
}

}  // namespace dmattn::cuda
