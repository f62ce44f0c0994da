// Split-KV decode over cache pages on the GPU. One CTA per (split, KV head [x row chunk], sequence)
// runs all query rows of its KV head (the G = Hq/Hkv query heads x Nq new queries: GQA-packed), so
// each page is read from memory once per KV head. Pages stream through shared memory by cp.async,
// double-buffered; scores and P.V run on the CUDA cores in the CPU oracle's arithmetic order
// (per-32-block dot products scaled by the two E8M0 scales, online softmax per page, P rounded to
// bf16); a second kernel merges the splits by LSE. Decode is memory-bound at small Nq: a page's
// bytes (K at 4.25 or 8.25 bits, V at 16) are the cost, the arithmetic is hidden under them.
#include "cuda/decode.cuh"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda/buffers.hpp"
#include "cuda/fp8.cuh"
#include "cuda/quantize.hpp"
#include "dmattn/error.hpp"
#include "dmattn/format.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int T = kTile;        // keys per page
constexpr int kThreads = 128;   // one thread per key of a page in the score phase
constexpr int kMaxRows = 64;    // query rows per CTA; more rows take more CTAs

struct Params {
  PagedKV kv;
  const uint8_t* q8[2];  // [rows][d] FP8 bytes of q's element values in the high / low format
  const uint8_t* qs[2];  // [rows][d/32] E8M0
  Elem kelem[2];         // K's element type per slot
  bool qe5m2[2];         // q's FP8 byte type per slot
  float* part;           // [rows][splits][d + 2]: unnormalised acc, m, l
  int Hq, Nq, G, splits, chunks;
  float scale;
};

template <int D>
struct Smem {  // byte offsets into dynamic shared memory
  static constexpr int kRow = D + 16;  // K row stride: 16-byte reads of 32 rows spread over all banks
  static constexpr int kK = T * kRow, kS = T * (D / 32), kV = T * D * 2;
  static constexpr int kStage = kK + kS + kV;
  static constexpr int bytes(int rows) {
    return 2 * kStage + (2 * rows * D + 2 * rows * (D / 32) + rows * T + 3 * rows) * int(sizeof(float));
  }
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// One 32-element block of a K row (in shared memory) as floats: the element values, unscaled.
template <Elem E>
__device__ __forceinline__ void k_block(const uint8_t* row, int c, float (&kv)[32]) {
  if constexpr (E == Elem::e2m1) {
    const uint4 w = *reinterpret_cast<const uint4*>(row + c * 16);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      // E2M1 magnitude m: 0, 0.5, else 2^((m>>1)-1) * (1 + (m&1)/2), built as float bits.
      const uint32_t code = (words[i / 8] >> (4 * (i % 8))) & 0xF, m = code & 7;
      const uint32_t mag = m == 0 ? 0u : m == 1 ? 0x3F000000u : (((m >> 1) + 126) << 23) | ((m & 1) << 22);
      kv[i] = __uint_as_float(((code & 8) << 28) | mag);
    }
  } else {
    const uint4 w0 = *reinterpret_cast<const uint4*>(row + c * 32), w1 = *reinterpret_cast<const uint4*>(row + c * 32 + 16);
    const uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const uint8_t code = uint8_t(words[i / 4] >> (8 * (i % 4)));
      if constexpr (E == Elem::e4m3 || E == Elem::e5m2)
        kv[i] = fp8_decode<E == Elem::e5m2>(code);
      else
        kv[i] = decode_elem(E, code);
    }
  }
}

// Scores of this thread's key (t) against rows [0, rows): sum over blocks of (sq * sk) * dot.
template <int D, int kR, Elem E>
__device__ __forceinline__ void page_scores(const uint8_t* krow, const uint8_t* kscale, const float* qv, const float* qsc,
                                            int rows, float (&s)[kR]) {
  constexpr int NB = D / 32;
#pragma unroll
  for (int r = 0; r < kR; ++r) s[r] = 0.0f;
#pragma unroll 1
  for (int c = 0; c < NB; ++c) {
    float kv[32];
    k_block<E>(krow, c, kv);
    const float sk = decode_e8m0(kscale[c]);
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      if (r >= rows) break;
      const float4* q4 = reinterpret_cast<const float4*>(qv + r * D + c * 32);
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 x = q4[i];
        dot += x.x * kv[4 * i];
        dot += x.y * kv[4 * i + 1];
        dot += x.z * kv[4 * i + 2];
        dot += x.w * kv[4 * i + 3];
      }
      s[r] += (qsc[r * NB + c] * sk) * dot;
    }
  }
}

template <int D, int kR>
__global__ void __launch_bounds__(kThreads) decode_kernel(const Params p) {
  constexpr int NB = D / 32, KG = kThreads / D;  // KG key groups share the columns in P.V
  using S_ = Smem<D>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int split = blockIdx.x, hk = blockIdx.y / p.chunks, chunk = blockIdx.y % p.chunks, s = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int R = p.G * p.Nq, r0 = chunk * kMaxRows, rows = min(kMaxRows, R - r0);
  // Rows of this CTA: (g, r) = ((r0 + i) / Nq, (r0 + i) % Nq); their q rows are consecutive.
  const int64_t qrow0 = (int64_t(s) * p.Hq + int64_t(hk) * p.G) * p.Nq + r0;
  float* qv = reinterpret_cast<float*>(smem + 2 * S_::kStage);  // [2][rows][D]
  float* qsc = qv + 2 * rows * D;                                // [2][rows][NB]
  float* P = qsc + 2 * rows * NB;                                // [rows][T]
  float* m = P + rows * T;                                       // [rows]
  float* l = m + rows;
  float* alpha = l + rows;

  const int L = p.kv.length[s], np = (L + T - 1) / T, eff = min(p.splits, np);
  auto out_part = [&](int i) { return p.part + ((qrow0 + i) * p.splits + split) * (D + 2); };
  if (split >= eff) {  // more splits than this sequence has pages: an empty partial
    for (int i = tid; i < rows; i += kThreads) out_part(i)[D] = -INFINITY;
    return;
  }
  const int j0 = int(int64_t(split) * np / eff), j1 = int(int64_t(split + 1) * np / eff);

  auto issue = [&](int j, int stage) {  // page j of the sequence into a stage buffer
    if (j < j1) {
      const int pid = p.kv.table[int64_t(s) * p.kv.max_pages + j];
      const int rowb = p.kelem[p.kv.slot[pid]] == Elem::e2m1 ? D / 2 : D;
      const int64_t base = (int64_t(pid) * p.kv.Hkv + hk) * T;
      uint8_t* st = smem + stage * S_::kStage;
      const uint8_t* gk = p.kv.codes + base * D;  // the slot's start; the rows are packed at rowb bytes
      const int kchunks = T * rowb / 16, per_row = rowb / 16;
      for (int i = tid; i < kchunks; i += kThreads)
        cp_async16(st + (i / per_row) * S_::kRow + (i % per_row) * 16, gk + i * 16);
      const uint8_t* gs = p.kv.scales + base * NB;
      for (int i = tid; i < S_::kS / 16; i += kThreads) cp_async16(st + S_::kK + i * 16, gs + i * 16);
      const uint8_t* gv = reinterpret_cast<const uint8_t*>(p.kv.v + base * D);
      for (int i = tid; i < S_::kV / 16; i += kThreads) cp_async16(st + S_::kK + S_::kS + i * 16, gv + i * 16);
    }
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  };
  issue(j0, 0);
  issue(j0 + 1, 1);

  for (int sl = 0; sl < 2; ++sl)
    for (int i = tid; i < rows * D; i += kThreads) {
      const int64_t row = qrow0 + i / D;
      const uint8_t b = p.q8[sl][row * D + i % D];
      qv[sl * rows * D + i] = p.qe5m2[sl] ? fp8_decode<true>(b) : fp8_decode<false>(b);
    }
  for (int sl = 0; sl < 2; ++sl)
    for (int i = tid; i < rows * NB; i += kThreads) qsc[sl * rows * NB + i] = decode_e8m0(p.qs[sl][qrow0 * NB + i]);
  for (int i = tid; i < rows; i += kThreads) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  float acc[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) acc[r] = 0.0f;
  const int c = tid % D, kg = tid / D;

  for (int j = j0; j < j1; ++j) {
    const int stage = (j - j0) % 2;
    cp_async_wait<1>();
    __syncthreads();
    const uint8_t* st = smem + stage * S_::kStage;
    const int pid = p.kv.table[int64_t(s) * p.kv.max_pages + j];
    const int sl = p.kv.slot[pid];
    const int keys = min(T, L - j * T);  // keys present in this page (the last row sees them all)
    {  // scores: thread tid = key
      float sc[kR];
      const float* q = qv + sl * rows * D;
      const float* qs = qsc + sl * rows * NB;
      const uint8_t* krow = st + tid * S_::kRow;
      const uint8_t* ks = st + S_::kK + tid * NB;
      switch (p.kelem[sl]) {
        case Elem::e4m3: page_scores<D, kR, Elem::e4m3>(krow, ks, q, qs, rows, sc); break;
        case Elem::e5m2: page_scores<D, kR, Elem::e5m2>(krow, ks, q, qs, rows, sc); break;
        case Elem::e3m2: page_scores<D, kR, Elem::e3m2>(krow, ks, q, qs, rows, sc); break;
        case Elem::e2m3: page_scores<D, kR, Elem::e2m3>(krow, ks, q, qs, rows, sc); break;
        case Elem::e2m1: page_scores<D, kR, Elem::e2m1>(krow, ks, q, qs, rows, sc); break;
      }
#pragma unroll
      for (int r = 0; r < kR; ++r)
        if (r < rows) P[r * T + tid] = sc[r] * p.scale;
    }
    __syncthreads();
    for (int r = warp; r < rows; r += kThreads / 32) {  // online softmax, one warp per row
      const int q_index = (r0 + r) % p.Nq;
      const int nvalid = min(T, L - p.Nq + q_index + 1 - j * T);  // causal, bottom-right
      float pr[4], mt = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pr[i] = P[r * T + lane + 32 * i];
        if (lane + 32 * i < nvalid) mt = fmaxf(mt, pr[i]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      if (nvalid <= 0) {  // this row sees no key of the page
#pragma unroll
        for (int i = 0; i < 4; ++i) P[r * T + lane + 32 * i] = 0.0f;
        if (lane == 0) alpha[r] = 1.0f;
        continue;
      }
      const float mnew = fmaxf(m[r], mt), a = expf(m[r] - mnew);
      float psum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float e = lane + 32 * i < nvalid ? expf(pr[i] - mnew) : 0.0f;
        psum += e;
        P[r * T + lane + 32 * i] = round_bf16(e);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
      __syncwarp();
      if (lane == 0) {
        l[r] = l[r] * a + psum;
        m[r] = mnew;
        alpha[r] = a;
      }
    }
    __syncthreads();
    {  // P.V: thread (column c, key group kg)
      const uint16_t* V = reinterpret_cast<const uint16_t*>(st + S_::kK + S_::kS);
#pragma unroll
      for (int r = 0; r < kR; ++r)
        if (r < rows) acc[r] *= alpha[r];
      const int kb = kg * (T / KG), ke = min(kb + T / KG, keys);
      for (int k = kb; k < ke; k += 4) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(uint32_t(V[(k + i) * D + c]) << 16);
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          if (r >= rows) break;
          const float4 pw = *reinterpret_cast<const float4*>(P + r * T + k);
          acc[r] += pw.x * v[0];
          acc[r] += pw.y * v[1];
          acc[r] += pw.z * v[2];
          acc[r] += pw.w * v[3];
        }
      }
    }
    __syncthreads();  // the stage is free again
    issue(j + 2, stage);
  }
  cp_async_wait<0>();
  if constexpr (KG > 1) {  // the key groups' partial sums, added in group order
    __syncthreads();
    for (int g = 1; g < KG; ++g) {
      if (kg == g)
#pragma unroll
        for (int r = 0; r < kR; ++r)
          if (r < rows) P[r * T + c] = acc[r];  // P's rows hold T >= D floats
      __syncthreads();
      if (kg == 0)
#pragma unroll
        for (int r = 0; r < kR; ++r)
          if (r < rows) acc[r] += P[r * T + c];
      __syncthreads();
    }
  }
  if (kg == 0) {
#pragma unroll
    for (int r = 0; r < kR; ++r)
      if (r < rows) out_part(r)[c] = acc[r];
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

template <int D, int kR>
void launch(const Params& p, dim3 grid, int rows, cudaStream_t stream) {
  const int bytes = Smem<D>::bytes(rows);
  check(cudaFuncSetAttribute(decode_kernel<D, kR>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
        "decode kernel attribute");
  decode_kernel<D, kR><<<grid, kThreads, bytes, stream>>>(p);
}

template <int D>
void launch_rows(const Params& p, dim3 grid, int rows, cudaStream_t stream) {
  if (rows <= 4)
    launch<D, 4>(p, grid, rows, stream);
  else if (rows <= 16)
    launch<D, 16>(p, grid, rows, stream);
  else
    launch<D, kMaxRows>(p, grid, rows, stream);
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
  if (policy.pv != PV::bf16) throw Error("the CUDA decode supports pv=bf16 for now; pv=mxfp8 decodes on the CPU");
  const Format fmt[2] = {policy.high, policy.low};
  Params p{};
  p.kv = kv;
  p.Hq = int(Hq);
  p.Nq = int(Nq);
  p.G = int(Hq / Hkv);
  p.chunks = (p.G * p.Nq + kMaxRows - 1) / kMaxRows;
  p.scale = scale;
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
    p.qe5m2[sl] = mma_elem(fmt[sl]) == Elem::e5m2;
    p.kelem[sl] = format_info(fmt[sl]).elem;
  }
  quantize_rows(q, policy.scale_rule, qt[0], qt[1], stream, nonfinite);  // one read of q for both formats
  p.part = buf.alloc<float>(size_t(rows * p.splits * (d + 2)) * sizeof(float));
  const dim3 grid(unsigned(p.splits), unsigned(Hkv * p.chunks), unsigned(S));
  const int cta_rows = std::min(p.G * p.Nq, kMaxRows);
  if (d == 64)
    launch_rows<64>(p, grid, cta_rows, stream);
  else
    launch_rows<128>(p, grid, cta_rows, stream);
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
