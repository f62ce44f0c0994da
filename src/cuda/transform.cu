// The accuracy transforms' pre-pass (transform.hpp). A warp holds a row of d channels as d/32 values
// a lane (channel lane + 32e), so the Hadamard butterfly's stages below 32 are lane shuffles and the
// rest register pairs: the same additions in the same stages as rotate_row on the host, so rotated
// rows are bit-identical. Means and dots accumulate in fp64 in the host oracle's order where a
// result is rounded once to fp32 (means of a query tile, key sums within a 128-row chunk).
#include "cuda/buffers.hpp"
#include "cuda/transform.hpp"
#include "dmattn/error.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/rotation.hpp"
#include "dmattn/policy.hpp"

namespace dmattn::cuda {
namespace {

constexpr int kMaxE = 8;  // d / 32 for d <= 256

// Row n of a [B, H, N, d] view (any strides) into this lane's channels lane + 32e, as fp32, rotated.
template <class T>
__device__ __forceinline__ void load_row(const T* x, const TensorView& v, int64_t b, int64_t h, int64_t n, int E,
                                         bool rotate, float (&r)[kMaxE]) {
  const int lane = threadIdx.x % 32;
  const T* row = x + b * v.stride[0] + h * v.stride[1] + n * v.stride[2];
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) r[e] = e < E ? to_float(row[(lane + 32 * e) * v.stride[3]]) : 0.0f;
  if (!rotate) return;
  const int d = 32 * E, blk = rotation_block(d);
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) r[e] *= e < E ? rotation_sign(lane + 32 * e) : 1.0f;
  for (int h = 1; h < blk && h < 32; h *= 2) {  // partners in other lanes
    const bool upper = lane & h;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e) {
      const float other = __shfl_xor_sync(0xffffffffu, r[e], h);
      r[e] = upper ? other - r[e] : r[e] + other;
    }
  }
  for (int h = 1; 32 * h < blk; h *= 2)  // partners in this lane's other registers
#pragma unroll
    for (int e = 0; e < kMaxE; ++e)
      if (e < E && !(e & h)) {
        const float a = r[e], c = r[e + h];
        r[e] = a + c;
        r[e + h] = a - c;
      }
}

// sum over the row of a[lane + 32e] * b[...] in fp64, the same value in every lane.
__device__ __forceinline__ double warp_dot(const float (&a)[kMaxE], const float (&b)[kMaxE], int E) {
  double s = 0;
#pragma unroll
  for (int e = 0; e < kMaxE; ++e)
    if (e < E) s += double(a[e]) * b[e];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

__device__ __forceinline__ void load_bf16_row(const uint16_t* row, int E, float (&r)[kMaxE]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int e = 0; e < kMaxE; ++e) r[e] = e < E ? to_float(bf16{row[lane + 32 * e]}) : 0.0f;
}

// K rows rotated; without smooth_k straight to bf16, with it to fp32 scratch plus each 128-row
// chunk's channel sums (fp64, rows in order). Grid: (chunks, B * Hkv); 4 warps.
template <class T>
__global__ void __launch_bounds__(128) k_rows_kernel(TensorView k, bool rotate, uint16_t* out, float* k_rot, double* part) {
  const int64_t bh = blockIdx.y, b = bh / k.shape[1], h = bh % k.shape[1], N = k.shape[2];
  const int E = int(k.shape[3] / 32), warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = 32 * E;
  __shared__ double sums[4][256];
  double acc[kMaxE] = {};
  for (int64_t n = int64_t(blockIdx.x) * 128 + warp; n < min(N, int64_t(blockIdx.x + 1) * 128); n += 4) {
    float r[kMaxE];
    load_row(static_cast<const T*>(k.data), k, b, h, n, E, rotate, r);
    const int64_t base = (bh * N + n) * d;
#pragma unroll
    for (int e = 0; e < kMaxE; ++e)
      if (e < E) {
        if (k_rot) {
          k_rot[base + lane + 32 * e] = r[e];
          acc[e] += r[e];
        } else {
          out[base + lane + 32 * e] = to_bf16(r[e]).bits;
        }
      }
  }
  if (!k_rot) return;
  // Rows n = warp (mod 4) summed per warp: the chunk's sum then adds the four in a fixed order.
#pragma unroll
  for (int e = 0; e < kMaxE; ++e)
    if (e < E) sums[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  for (int c = threadIdx.x; c < d; c += 128)
    part[(bh * gridDim.x + blockIdx.x) * d + c] = ((sums[0][c] + sums[1][c]) + sums[2][c]) + sums[3][c];
}

// kmean = (sum of the chunks' sums) / N; grid B * Hkv, a thread a channel.
__global__ void kmean_kernel(const double* part, int chunks, int d, int64_t N, float* kmean) {
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    double s = 0;
    for (int i = 0; i < chunks; ++i) s += part[(int64_t(blockIdx.x) * chunks + i) * d + c];
    kmean[int64_t(blockIdx.x) * d + c] = float(s / double(N));
  }
}

// k' = bf16(k_rot - kmean), elementwise.
__global__ void k_center_kernel(const float* k_rot, const float* kmean, int64_t n_per_head, int d, int64_t total,
                                uint16_t* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = to_bf16(k_rot[i] - kmean[(i / n_per_head) * d + i % d]).bits;
}

struct QArgs {
  TensorView q;
  bool rotate, smooth_q;
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
// (qtiles, Hq, B); 4 warps; dynamic shared memory: the tile's rows as fp32 (smooth_q).
template <class T>
__global__ void __launch_bounds__(128) q_rows_kernel(QArgs a) {
  extern __shared__ float rows[];  // [128][d]
  __shared__ float mu[256];
  const int64_t b = blockIdx.z, h = blockIdx.y, c = blockIdx.x, Nq = a.q.shape[2], Hq = a.q.shape[1];
  const int64_t hk = h / (Hq / a.Hkv), bhq = b * Hq + h, kv_head = (b * a.Hkv + hk) * a.Nk;
  const int E = int(a.q.shape[3] / 32), d = 32 * E, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = max(int64_t(0), (a.qtile0 + c) * 128 - a.q_pos0), r1 = min(Nq, (a.qtile0 + c + 1) * 128 - a.q_pos0);
  for (int64_t r = r0 + warp; r < r1; r += 4) {
    float x[kMaxE];
    load_row(static_cast<const T*>(a.q.data), a.q, b, h, r, E, a.rotate, x);
    const int64_t row = bhq * Nq + r;
    for (int n = 0; n < a.sink; ++n) {
      float kv[kMaxE];
      load_bf16_row(a.k + (kv_head + n) * d, E, kv);
      const double s = warp_dot(x, kv, E);
      if (lane == 0) a.sinks[row * a.sink + n] = float(s) * a.scale;
    }
    if (a.kmean) {
      float km[kMaxE];
#pragma unroll
      for (int e = 0; e < kMaxE; ++e) km[e] = e < E ? a.kmean[(b * a.Hkv + hk) * d + lane + 32 * e] : 0.0f;
      const double s = warp_dot(x, km, E);
      if (lane == 0) a.lse_shift[row] = float(s) * a.scale;
    }
#pragma unroll
    for (int e = 0; e < kMaxE; ++e)
      if (e < E) {
        if (a.smooth_q)
          rows[(r - r0) * d + lane + 32 * e] = x[e];
        else
          a.out[row * d + lane + 32 * e] = to_bf16(x[e]).bits;
      }
  }
  if (!a.smooth_q) return;
  __syncthreads();
  for (int ch = threadIdx.x; ch < d; ch += 128) {
    double s = 0;
    for (int64_t r = r0; r < r1; ++r) s += rows[(r - r0) * d + ch];
    mu[ch] = float(s / double(r1 - r0));
    a.qmean[(bhq * a.qtiles + c) * d + ch] = mu[ch];
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < (r1 - r0) * d; i += 128)
    a.out[(bhq * Nq + r0) * d + i] = to_bf16(rows[i] - mu[i % d]).bits;
}

// smooth_q's correction ds[b*Hq + h][c][n] = scale * mu(c).k'[n] (fp32 over the channels in order)
// for the keys tile c sees. Grid (key chunks of 128, B * Hkv); 128 threads, a key each; dynamic
// shared memory: the chunk's keys as fp32 [128][d + 1].
__global__ void __launch_bounds__(128) delta_s_kernel(const uint16_t* k, const float* qmean, int64_t Hkv, int64_t G,
                                                      int64_t Nk, int d, int64_t ldv, int64_t qtiles, int64_t qtile0,
                                                      int64_t q_last, bool causal, float scale, float* ds) {
  extern __shared__ float keys[];  // [128][d + 1]
  const int64_t bh = blockIdx.y, j = blockIdx.x, n0 = j * 128;
  for (int64_t i = threadIdx.x; i < int64_t(128) * d; i += 128) {
    const int64_t n = n0 + i / d;
    keys[(i / d) * (d + 1) + i % d] = n < Nk ? to_float(bf16{k[(bh * Nk + n) * d + i % d]}) : 0.0f;
  }
  __syncthreads();
  const int64_t b = bh / Hkv, hk = bh % Hkv, Hq = Hkv * G, n = n0 + threadIdx.x;
  const float* kr = keys + threadIdx.x * (d + 1);
  for (int64_t c = 0; c < qtiles; ++c) {
    // Causal: tile c's rows see keys up to its last row's position (q_last caps it).
    const int64_t last = min(q_last, (qtile0 + c + 1) * 128 - 1);
    if (causal && n0 > last) continue;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t bhq = b * Hq + hk * G + g;
      const float* mu = qmean + (bhq * qtiles + c) * d;
      float s = 0.0f;
      for (int i = 0; i < d; ++i) s = fmaf(mu[i], kr[i], s);
      ds[(bhq * qtiles + c) * ldv + n] = n < Nk ? s * scale : 0.0f;
    }
  }
}

__global__ void lse_shift_kernel(float* lse, const float* shift, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    lse[i] += shift[i];
}

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + 255) / 256, 132 * 16)); }

}  // namespace

void query_tiles(const Problem& p, int64_t& first, int64_t& count) {
  const int64_t pos0 = p.q_pos0 - p.k_pos0;
  first = hd::floor_div(pos0, kTile);
  count = hd::floor_div(pos0 + p.Nq - 1, kTile) - first + 1;
}

void transform_qk(const Problem& p, const Transformed& t, float scale, cudaStream_t stream) {
  const Policy& pol = p.policy;
  const int d = int(p.d), E = d / 32;
  if (d > 256 || d % 32 != 0) throw Error("transform_qk: head dims up to 256");
  const int64_t chunks = (p.Nk + kTile - 1) / kTile, ldv = chunks * kTile;
  with_typed(p.k, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    k_rows_kernel<T><<<dim3(unsigned(chunks), unsigned(p.B * p.Hkv)), 128, 0, stream>>>(
        p.k, pol.rotate, t.k, pol.smooth_k ? t.k_rot : nullptr, t.k_part);
  });
  check(cudaGetLastError(), "k_rows_kernel");
  if (pol.smooth_k) {
    kmean_kernel<<<unsigned(p.B * p.Hkv), 128, 0, stream>>>(t.k_part, int(chunks), d, p.Nk, t.kmean);
    const int64_t total = p.B * p.Hkv * p.Nk * d;
    k_center_kernel<<<grid_for(total), 256, 0, stream>>>(t.k_rot, t.kmean, p.Nk * d, d, total, t.k);
    check(cudaGetLastError(), "k_center_kernel");
  }
  QArgs a{p.q, pol.rotate, pol.smooth_q, p.Hkv, p.Nk, p.q_pos0 - p.k_pos0, t.qtile0, scale, t.k,
          t.lse_shift ? t.kmean : nullptr, t.sink_keys, t.q, t.qmean, t.lse_shift, t.sink, t.qtiles};
  const size_t smem = pol.smooth_q ? size_t(128) * d * sizeof(float) : 0;
  with_typed(p.q, [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    check(cudaFuncSetAttribute(q_rows_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "q_rows smem");
    q_rows_kernel<T><<<dim3(unsigned(t.qtiles), unsigned(p.Hq), unsigned(p.B)), 128, smem, stream>>>(a);
  });
  check(cudaGetLastError(), "q_rows_kernel");
  if (pol.smooth_q) {
    const size_t ksmem = size_t(128) * (d + 1) * sizeof(float);
    check(cudaFuncSetAttribute(delta_s_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ksmem)), "delta_s smem");
    delta_s_kernel<<<dim3(unsigned(chunks), unsigned(p.B * p.Hkv)), 128, ksmem, stream>>>(
        t.k, t.qmean, p.Hkv, p.group(), p.Nk, d, ldv, t.qtiles, t.qtile0, p.q_pos0 - p.k_pos0 + p.Nq - 1, p.causal,
        scale, t.ds);
    check(cudaGetLastError(), "delta_s_kernel");
  }
  (void)E;
}

void add_lse_shift(float* lse, const float* shift, int64_t n, cudaStream_t stream) {
  lse_shift_kernel<<<grid_for(n), 256, 0, stream>>>(lse, shift, n);
  check(cudaGetLastError(), "lse_shift_kernel");
}

}  // namespace dmattn::cuda
