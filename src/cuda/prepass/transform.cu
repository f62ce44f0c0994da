// The accuracy transforms' pre-pass (transform.hpp). A warp holds a row of d = 32 E channels, E
// contiguous channels a lane (lane E + e), so the Hadamard butterfly's stages below E are register
// pairs and the rest lane shuffles: the same additions in the same stages as rotate_row on the host,
// so rotated rows are bit-identical. Means and dots accumulate in fp64 and round once to fp32.
#include <algorithm>
#include <type_traits>

#include "cuda/common/buffers.hpp"
#include "cuda/ptx/mma.cuh"
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
  if constexpr (sizeof(T) == 2 && E >= 2) {
    if (vec) {
      using V = std::conditional_t<E == 2, uint32_t, std::conditional_t<E == 4, uint2, uint4>>;
      const V w = *reinterpret_cast<const V*>(row + lane * E);
      const uint16_t* h16 = reinterpret_cast<const uint16_t*>(&w);
#pragma unroll
      for (int e = 0; e < E; ++e) r[e] = to_float(T{h16[e]});
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) r[e] = to_float(row[(lane * E + e) * v.stride[3]]);
    }
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

// K rows rotated, minus sub[b*Hkv + h] where given (smooth_k's mean), to bf16 (out) and/or into each
// 128-row chunk's channel sums (part, fp64, before any subtraction). Grid: (chunks, B * Hkv); kWarps warps.
template <class T, int E>
__global__ void __launch_bounds__(kRowThreads) k_rows_kernel(TensorView k, bool vec, bool rotate, const float* sub,
                                                             uint16_t* out, double* part) {
  constexpr int d = 32 * E;
  const int64_t bh = blockIdx.y, b = bh / k.shape[1], h = bh % k.shape[1], N = k.shape[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ double sums[kWarps][d];
  double acc[E] = {};
  float m[E] = {};
  if (sub)
#pragma unroll
    for (int e = 0; e < E; ++e) m[e] = sub[bh * d + lane * E + e];
  for (int64_t n = int64_t(blockIdx.x) * 128 + warp; n < min(N, int64_t(blockIdx.x + 1) * 128); n += kWarps) {
    float r[E];
    load_row<T, E>(k, b, h, n, vec, rotate, r);
    if (part)
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] += r[e];
    if (out) {
#pragma unroll
      for (int e = 0; e < E; ++e) r[e] -= m[e];
      store_bf16<E>(out + (bh * N + n) * d, r);
    }
  }
  if (!part) return;
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

// kmean = (sum of the chunks' sums) / N; grid B * Hkv, a thread a channel.
__global__ void kmean_kernel(const double* part, int chunks, int d, int64_t N, float* kmean) {
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    double s = 0;
    for (int i = 0; i < chunks; ++i) s += part[(int64_t(blockIdx.x) * chunks + i) * d + c];
    kmean[int64_t(blockIdx.x) * d + c] = float(s / double(N));
  }
}

struct QArgs {
  TensorView q;
  bool vec, rotate, smooth_q;
  int64_t Hkv, Nk, q_pos0, qtile0;  // q_pos0: row 0's position from key 0
  float scale;
  const uint16_t* k;   // transformed K [B, Hkv, Nk, d] (the sink scores)
  const float* kmean;  // smooth_k with an LSE: [B*Hkv, d] (the LSE shift), else null
  int sink;
  uint16_t* out;
  float *qmean, *lse_shift, *sinks;
  int64_t qtiles;
};

// One query tile's rows of one (b, h): rotated; the exact sink scores and the LSE shift from the
// rotated rows; with smooth_q the tile's mean (fp64 over its rows in order) subtracted. Grid
// (qtiles, Hq, B); kWarps warps; dynamic shared memory: the tile's rows as fp32 (smooth_q).
template <class T, int E>
__global__ void __launch_bounds__(kRowThreads) q_rows_kernel(QArgs a) {
  constexpr int d = 32 * E;
  extern __shared__ float rows[];  // [128][d]
  __shared__ float mu[d];
  const int64_t b = blockIdx.z, h = blockIdx.y, c = blockIdx.x, Nq = a.q.shape[2], Hq = a.q.shape[1];
  const int64_t hk = h / (Hq / a.Hkv), bhq = b * Hq + h, kv_head = (b * a.Hkv + hk) * a.Nk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = max(int64_t(0), (a.qtile0 + c) * 128 - a.q_pos0), r1 = min(Nq, (a.qtile0 + c + 1) * 128 - a.q_pos0);
  float km[E];
  if (a.kmean)
#pragma unroll
    for (int e = 0; e < E; ++e) km[e] = a.kmean[(b * a.Hkv + hk) * d + lane * E + e];
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
      const double s = warp_dot<E>(x, km);
      if (lane == 0) a.lse_shift[row] = float(s) * a.scale;
    }
    if (a.smooth_q) {
#pragma unroll
      for (int e = 0; e < E; ++e) rows[(r - r0) * d + lane * E + e] = x[e];
    } else if (a.out) {
      store_bf16<E>(a.out + row * d, x);
    }
  }
  if (!a.smooth_q) return;
  __syncthreads();
  for (int ch = threadIdx.x; ch < d; ch += kRowThreads) {
    double s = 0;
    for (int64_t r = r0; r < r1; ++r) s += rows[(r - r0) * d + ch];
    mu[ch] = float(s / double(r1 - r0));
    a.qmean[(bhq * a.qtiles + c) * d + ch] = mu[ch];
  }
  __syncthreads();
  float m[E];
#pragma unroll
  for (int e = 0; e < E; ++e) m[e] = mu[lane * E + e];
  for (int64_t r = r0 + warp; r < r1; r += kWarps) {
    float x[E];
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = rows[(r - r0) * d + lane * E + e] - m[e];
    store_bf16<E>(a.out + (bhq * Nq + r) * d, x);
  }
}

// smooth_q's correction ds[b*Hq + h][c][n] = scale * mu(c).k'[n] on the tensor cores: mu split into
// bf16 high and low parts (mu - hi is exact in fp32 and its bf16 rounding leaves ~2^-16 of mu), k'
// already bf16, so hi.k' + lo.k' in fp32 accumulation is mu.k' to ~1e-5. One CTA a 128-key chunk
// of one (b, kv head): its keys in shared memory, then 16 query-tile rows (mu of (tile c, head g)
// at row c * G + g) at a time, each of 4 warps 32 keys, m16n8k16 over 2d contraction slots.
// Causal: only the tiles that see the chunk (a suffix of the rows).
__global__ void __launch_bounds__(128) delta_s_kernel(const uint16_t* k, const float* qmean, int64_t Hkv, int G,
                                                      int64_t Nk, int d, int64_t ldv, int64_t qtiles, int64_t qtile0,
                                                      bool causal, float scale, float* ds) {
  extern __shared__ uint32_t keys[];  // [128][d / 2 + 4] bf16 pairs (padded against bank conflicts)
  const int pitch = d / 2 + 4;
  const int64_t bh = blockIdx.y, j = blockIdx.x, n0 = j * 128;
  for (int i = threadIdx.x; i < 128 * (d / 2); i += 128) {
    const int r = i / (d / 2), w = i % (d / 2);
    const int64_t n = n0 + r;
    keys[r * pitch + w] = n < Nk ? reinterpret_cast<const uint32_t*>(k + (bh * Nk + n) * d)[w] : 0u;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = bh / Hkv, hk = bh % Hkv, Hq = Hkv * G;
  // Tile c sees this chunk unless causal and the chunk starts at or after the tile's end.
  const int64_t c_first = causal ? std::max<int64_t>(0, j - qtile0) : 0;
  const int64_t rows = qtiles * G;
  // Row m's (bhq, tile): mu at qmean + mu_off(m), its ds row at ds + mu_off(m) / d * ldv.
  auto mu_off = [&](int64_t m) { return ((b * Hq + hk * G + m % G) * qtiles + m / G) * d; };
  for (int64_t m0 = c_first * G; m0 < rows; m0 += 16) {
    const int64_t mr[2] = {m0 + g, m0 + g + 8};
    const bool ok[2] = {mr[0] < rows, mr[1] < rows};
    const int64_t off[2] = {ok[0] ? mu_off(mr[0]) : 0, ok[1] ? mu_off(mr[1]) : 0};
    float acc[4][4] = {};
    for (int kk = 0; kk < d; kk += 16) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // a[q]: row g (+8 for q odd), channels kk + 2t (+8 for q >= 2)
        const float2 v = ok[q % 2] ? *reinterpret_cast<const float2*>(qmean + off[q % 2] + kk + 2 * t + 8 * (q / 2))
                                   : make_float2(0.0f, 0.0f);
        hi[q] = bf16x2_rn(v.x, v.y);
        const float hx = to_float(bf16{uint16_t(hi[q] & 0xFFFFu)}), hy = to_float(bf16{uint16_t(hi[q] >> 16)});
        lo[q] = bf16x2_rn(v.x - hx, v.y - hy);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {  // keys warp * 32 + nt * 8 + g
        const uint32_t* kr = keys + (warp * 32 + nt * 8 + g) * pitch + kk / 2 + t;
        mma_16816<true>(acc[nt], hi, kr[0], kr[4]);
        mma_16816<true>(acc[nt], lo, kr[0], kr[4]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // c[q]: row g (+8 for q >= 2), key 2t + q % 2
        const int64_t n = n0 + warp * 32 + nt * 8 + 2 * t + q % 2;
        if (ok[q / 2]) ds[off[q / 2] / d * ldv + n] = n < Nk ? acc[nt][q] * scale : 0.0f;
      }
  }
}

__global__ void lse_shift_kernel(float* lse, const float* shift, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    lse[i] += shift[i];
}

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + 255) / 256, 132 * 16)); }

// Whether a view's rows can be read as vectors of E 16-bit elements.
bool vector_rows(const TensorView& v, int E) {
  if (dtype_size(v.dtype) != 2 || v.stride[3] != 1) return false;
  const int64_t align = E * 2;
  if (reinterpret_cast<uintptr_t>(v.data) % uintptr_t(align) != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (v.stride[i] % E != 0) return false;
  return true;
}

template <int E>
void key_means_d(const Problem& p, double* part, float* kmean, cudaStream_t stream) {
  const int64_t chunks = (p.Nk + kTile - 1) / kTile;
  with_typed(p.k, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    k_rows_kernel<T, E><<<dim3(unsigned(chunks), unsigned(p.B * p.Hkv)), kRowThreads, 0, stream>>>(
        p.k, vector_rows(p.k, E), p.policy.rotate, nullptr, nullptr, part);
  });
  check(cudaGetLastError(), "k_rows_kernel");
  kmean_kernel<<<unsigned(p.B * p.Hkv), 128, 0, stream>>>(part, int(chunks), 32 * E, p.Nk, kmean);
}

template <int E>
void transform_d(const Problem& p, const Transformed& t, float scale, cudaStream_t stream) {
  constexpr int d = 32 * E;
  const Policy& pol = p.policy;
  const int64_t chunks = (p.Nk + kTile - 1) / kTile, ldv = chunks * kTile;
  if (pol.smooth_k) key_means_d<E>(p, t.k_part, t.kmean, stream);
  with_typed(p.k, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    k_rows_kernel<T, E><<<dim3(unsigned(chunks), unsigned(p.B * p.Hkv)), kRowThreads, 0, stream>>>(
        p.k, vector_rows(p.k, E), pol.rotate, pol.smooth_k ? t.kmean : nullptr, t.k, nullptr);
  });
  check(cudaGetLastError(), "k_rows_kernel");
  QArgs a{p.q, vector_rows(p.q, E), pol.rotate, pol.smooth_q, p.Hkv, p.Nk, p.q_pos0 - p.k_pos0, t.qtile0, scale, t.k,
          t.lse_shift ? t.kmean : nullptr, t.sink_keys, t.q, t.qmean, t.lse_shift, t.sink, t.qtiles};
  const size_t smem = pol.smooth_q ? size_t(128) * d * sizeof(float) : 0;
  with_typed(p.q, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    check(cudaFuncSetAttribute(q_rows_kernel<T, E>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "q_rows smem");
    q_rows_kernel<T, E><<<dim3(unsigned(t.qtiles), unsigned(p.Hq), unsigned(p.B)), kRowThreads, smem, stream>>>(a);
  });
  check(cudaGetLastError(), "q_rows_kernel");
  if (pol.smooth_q) {
    const size_t ksmem = size_t(128) * (d / 2 + 4) * sizeof(uint32_t);
    check(cudaFuncSetAttribute(delta_s_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ksmem)), "delta_s smem");
    delta_s_kernel<<<dim3(unsigned(chunks), unsigned(p.B * p.Hkv)), 128, ksmem, stream>>>(
        t.k, t.qmean, p.Hkv, int(p.group()), p.Nk, d, ldv, t.qtiles, t.qtile0, p.causal, scale, t.ds);
    check(cudaGetLastError(), "delta_s_kernel");
  }
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
                  cudaStream_t stream) {
  QArgs a{p.q, vector_rows(p.q, E), p.policy.rotate, false, p.Hkv, p.Nk, p.q_pos0 - p.k_pos0, qtile0, scale, nullptr,
          kmean, 0, nullptr, nullptr, shift, nullptr, qtiles};
  with_typed(p.q, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    q_rows_kernel<T, E><<<dim3(unsigned(qtiles), unsigned(p.Hq), unsigned(p.B)), kRowThreads, 0, stream>>>(a);
  });
  check(cudaGetLastError(), "q_rows_kernel");
}

void key_means(const Problem& p, double* part, float* kmean, cudaStream_t stream) {
  by_head_dim(p.d, [&](auto e) { key_means_d<decltype(e)::value>(p, part, kmean, stream); });
}

void lse_shifts(const Problem& p, const float* kmean, float scale, int64_t qtile0, int64_t qtiles, float* shift,
                cudaStream_t stream) {
  by_head_dim(p.d, [&](auto e) { lse_shifts_d<decltype(e)::value>(p, kmean, scale, qtile0, qtiles, shift, stream); });
}

void add_lse_shift(float* lse, const float* shift, int64_t n, cudaStream_t stream) {
  lse_shift_kernel<<<grid_for(n), 256, 0, stream>>>(lse, shift, n);
  check(cudaGetLastError(), "lse_shift_kernel");
}

}  // namespace dmattn::cuda
