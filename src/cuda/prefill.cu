// DMA prefill on tensor cores (mma.sync; a first, correct kernel — the wgmma/TMA kernel replaces
// it). One CTA = one 128-position query tile (aligned in absolute positions, so one format per key
// tile) x its key tiles, ascending; 8 warps x 16 rows. K (in the tile's format) and V stream into a
// double buffer with cp.async while the previous tile computes; S by one FP8 MMA per 32-wide MX
// block into a fresh accumulator, promoted with the block scales on the CUDA cores (DESIGN §5,
// exact MX scaling); online softmax in fp32; P rounded to bf16 times bf16 V. Heavy (late) causal
// tiles are scheduled first.
#include <cmath>

#include "cuda/mma.cuh"
#include "cuda/prefill.cuh"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace {

constexpr int BM = kPrefillRows, BN = kTile, kThreads = BM * 2;  // 8 warps x 16 rows

template <int D>
struct Smem {
  static constexpr int kNb = D / 32;
  static constexpr int kKStride = D + 16;  // bytes per K row; the pad spreads rows over banks
  static constexpr int kVStride = D + 8;   // bf16 per V row
  static constexpr int kK = BN * kKStride, kKs = BN * kNb * 4, kV = BN * kVStride * 2;
  static constexpr int kStage = kK + kKs + kV;                           // one key tile
  static constexpr int kQ = 2 * BM * kKStride, kQs = 2 * BM * kNb * 4;  // both slots' Q rows
  static constexpr int kBytes = 2 * kStage + kQ + kQs;
};

// 16-byte global->shared copy that bypasses registers; zero-fills when `valid` is false.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int D, class TOut>
__global__ void __launch_bounds__(kThreads, 1) prefill_kernel(const PrefillParams p) {
  using S = Smem<D>;
  constexpr int NB = S::kNb;
  extern __shared__ __align__(16) uint8_t smem[];
  // Stage st: K bytes [BN][kKStride], K scales as floats [BN][NB], V bf16 [BN][kVStride].
  auto sK = [&](int st) { return smem + st * S::kStage; };
  auto sKs = [&](int st) { return reinterpret_cast<float*>(smem + st * S::kStage + S::kK); };
  auto sV = [&](int st) { return reinterpret_cast<uint16_t*>(smem + st * S::kStage + S::kK + S::kKs); };
  uint8_t* sQ = smem + 2 * S::kStage;                                // [2][BM][kKStride]
  float* sQs = reinterpret_cast<float*>(sQ + S::kQ);             // [2][BM][NB]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.Hq / p.Hkv);
  const int64_t off = int64_t(p.Nk) - p.Nq;
  const int64_t pos0 = (p.first_block + (p.blocks - 1 - blockIdx.x)) * BM;  // late tiles first
  const int64_t qtile = hd::floor_div(pos0, kTile);
  const int64_t pos[2] = {pos0 + warp * 16 + g, pos0 + warp * 16 + g + 8};
  const int64_t row[2] = {pos[0] - off, pos[1] - off};
  const bool valid[2] = {row[0] >= 0 && row[0] < p.Nq, row[1] >= 0 && row[1] < p.Nq};
  const int nslots = p.q8[1] ? 2 : 1;
  // The last key each of this thread's rows sees (-1: none). Fits int: the host checks Nk < 2^31.
  int kmax[2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
    kmax[r] = !valid[r] ? -1 : p.causal ? int(min(int64_t(p.Nk) - 1, pos[r])) : p.Nk - 1;

  // Q rows of this CTA in both slots to shared memory (zeros for rows outside [0, Nq)); the MMA
  // fragments are read per tile from there, which keeps registers for S and O.
  for (int i = threadIdx.x; i < 2 * BM * D / 16; i += kThreads) {
    const int s = i / (BM * D / 16), r = (i / (D / 16)) % BM, chunk = i % (D / 16);
    const int64_t qrow = pos0 + r - off;
    uint4 w = make_uint4(0, 0, 0, 0);
    if (s < nslots && qrow >= 0 && qrow < p.Nq)
      w = *reinterpret_cast<const uint4*>(p.q8[s] + ((int64_t(b) * p.Hq + h) * p.Nq + qrow) * D + chunk * 16);
    *reinterpret_cast<uint4*>(sQ + (s * BM + r) * S::kKStride + chunk * 16) = w;
  }
  for (int i = threadIdx.x; i < 2 * BM * NB; i += kThreads) {
    const int s = i / (BM * NB), r = (i / NB) % BM, c = i % NB;
    const int64_t qrow = pos0 + r - off;
    const bool ok = s < nslots && qrow >= 0 && qrow < p.Nq;
    sQs[i] = ok ? decode_e8m0(p.qs[s][((int64_t(b) * p.Hq + h) * p.Nq + qrow) * NB + c]) : 0.0f;
  }

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const int64_t kend = p.causal ? min(int64_t(p.Nk), max(int64_t(0), pos0 + BM)) : int64_t(p.Nk);
  const int64_t tiles = (kend + BN - 1) / BN;
  const int64_t kv_base = (int64_t(b) * p.Hkv + hk) * p.Nk;

  auto slot_of = [&](int64_t j) { return (nslots == 2 && !p.policy.is_high(qtile, j)) ? 1 : 0; };
  // Issues the asynchronous copies of key tile j's K (its format) and V into stage st.
  auto issue = [&](int64_t j, int st) {
    const uint8_t* k8 = slot_of(j) ? p.k8[1] : p.k8[0];
    for (int i = threadIdx.x; i < BN * D / 16; i += kThreads) {
      const int key = i / (D / 16), chunk = i % (D / 16);
      const int64_t gk = min(j * BN + key, int64_t(p.Nk) - 1);  // clamped address; zero-filled below
      cp_async16(sK(st) + key * S::kKStride + chunk * 16, k8 + (kv_base + gk) * D + chunk * 16, j * BN + key < p.Nk);
    }
    for (int i = threadIdx.x; i < BN * D / 8; i += kThreads) {
      const int key = i / (D / 8), chunk = i % (D / 8);
      const int64_t gk = min(j * BN + key, int64_t(p.Nk) - 1);
      cp_async16(sV(st) + key * S::kVStride + chunk * 8, p.v + (kv_base + gk) * D + chunk * 8, j * BN + key < p.Nk);
    }
    cp_async_commit();
  };
  // K block scales (unaligned in general, so plain loads), decoded to floats.
  auto load_scales = [&](int64_t j, int st) {
    const uint8_t* ks = slot_of(j) ? p.ks[1] : p.ks[0];
    for (int i = threadIdx.x; i < BN * NB; i += kThreads) {
      const int64_t gk = j * BN + i / NB;
      sKs(st)[i] = gk < p.Nk ? decode_e8m0(ks[(kv_base + gk) * NB + i % NB]) : 0.0f;
    }
  };

  if (tiles > 0) {
    issue(0, 0);
    load_scales(0, 0);
  }
  for (int64_t j = 0; j < tiles; ++j) {
    const int slot = slot_of(j), st = int(j & 1);
    const bool e5m2 = slot ? p.e5m2[1] : p.e5m2[0];
    if (j + 1 < tiles) {
      issue(j + 1, st ^ 1);  // stage st^1 was released by the barrier that ended iteration j-1
      load_scales(j + 1, st ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile j's K, V and scales are visible to every warp
    const uint8_t* sKt = sK(st);
    const float* sKst = sKs(st);
    const uint16_t* sVt = sV(st);

    // S = sum over MX blocks c of (sq * sk) * (Q_c . K_c), each block one MMA.
    float s[BN / 8][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll 1  // one MX block at a time: unrolling c hoists loads and spills registers
    for (int c = 0; c < NB; ++c) {
      const uint8_t* qr = sQ + (slot * BM + warp * 16 + g) * S::kKStride + c * 32 + t * 4;
      const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(qr), *reinterpret_cast<const uint32_t*>(qr + 8 * S::kKStride),
                             *reinterpret_cast<const uint32_t*>(qr + 16),
                             *reinterpret_cast<const uint32_t*>(qr + 8 * S::kKStride + 16)};
      const float qs0 = sQs[(slot * BM + warp * 16 + g) * NB + c], qs1 = sQs[(slot * BM + warp * 16 + g + 8) * NB + c];
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        const uint8_t* kr = sKt + (nt * 8 + g) * S::kKStride + c * 32 + t * 4;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr), b1 = *reinterpret_cast<const uint32_t*>(kr + 16);
        float part[4];
        if (e5m2)
          mma_fp8_block<true>(part, a, b0, b1);
        else
          mma_fp8_block<false>(part, a, b0, b1);
        const float k0 = sKst[(nt * 8 + 2 * t) * NB + c], k1 = sKst[(nt * 8 + 2 * t + 1) * NB + c];
        s[nt][0] += (qs0 * k0) * part[0];
        s[nt][1] += (qs0 * k1) * part[1];
        s[nt][2] += (qs1 * k0) * part[2];
        s[nt][3] += (qs1 * k1) * part[3];
      }
    }

    // Scale, mask, online softmax (fp32). Tiles every row of the warp sees whole skip the mask.
    float mx[2] = {-INFINITY, -INFINITY};
    const int key0 = int(j) * BN;
    if (__all_sync(0xffffffffu, key0 + BN - 1 <= min(kmax[0], kmax[1]))) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] *= p.scale;
          mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + nt * 8 + 2 * t + (e & 1);
          s[nt][e] = key <= kmax[e / 2] ? s[nt][e] * p.scale : -INFINITY;
          mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
        }
    }
    float alpha[2], mref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float mnew = fmaxf(m[r], quad_max(mx[r]));
      // A row that has seen no key yet keeps its state (as if the tile were skipped).
      alpha[r] = mnew == -INFINITY ? 1.0f : __expf(m[r] - mnew);
      mref[r] = mnew == -INFINITY ? 0.0f : mnew;
      m[r] = mnew;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = __expf(s[nt][e] - mref[e / 2]);
        l[e / 2] += s[nt][e];
      }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[0];
      o[i][2] *= alpha[1];
      o[i][3] *= alpha[1];
    }

    // O += bf16(P) . bf16(V), 16 keys per MMA.
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[4];
      a[0] = pack_bf16(to_bf16(s[2 * kc][0]).bits, to_bf16(s[2 * kc][1]).bits);
      a[1] = pack_bf16(to_bf16(s[2 * kc][2]).bits, to_bf16(s[2 * kc][3]).bits);
      a[2] = pack_bf16(to_bf16(s[2 * kc + 1][0]).bits, to_bf16(s[2 * kc + 1][1]).bits);
      a[3] = pack_bf16(to_bf16(s[2 * kc + 1][2]).bits, to_bf16(s[2 * kc + 1][3]).bits);
      // ldmatrix.trans: lanes 0-15 address the tile's 16 key rows; each yields two n8 B fragments.
      const uint16_t* vrow = sVt + (kc * 16 + (lane % 16)) * S::kVStride + (lane / 16) * 8;
#pragma unroll
      for (int dn = 0; dn < D / 8; dn += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vrow + dn * 8);
        mma_bf16_acc(o[dn], a, b[0], b[1]);
        mma_bf16_acc(o[dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with stage st before it is refilled
  }

  // out = O / l, lse = m + log l; rows that saw no key write zeros and -inf.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lr = quad_sum(l[r]);
    if (!valid[r]) continue;
    TOut* orow = static_cast<TOut*>(p.out) + b * p.out_sb + h * p.out_sh + row[r] * p.out_sn;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      orow[dn * 8 + 2 * t] = from_float<TOut>(lr > 0.0f ? o[dn][2 * r] / lr : 0.0f);
      orow[dn * 8 + 2 * t + 1] = from_float<TOut>(lr > 0.0f ? o[dn][2 * r + 1] / lr : 0.0f);
    }
    if (p.lse && t == 0) p.lse[(int64_t(b) * p.Hq + h) * p.Nq + row[r]] = lr > 0.0f ? m[r] + logf(lr) : -INFINITY;
  }
}

template <int D, class TOut>
void launch(const PrefillParams& p, int64_t blocks, int batch, cudaStream_t stream) {
  constexpr int bytes = Smem<D>::kBytes;
  auto kernel = prefill_kernel<D, TOut>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  kernel<<<dim3(unsigned(blocks), unsigned(p.Hq), unsigned(batch)), kThreads, bytes, stream>>>(p);
}

template <int D>
void launch_d(const PrefillParams& p, DType out, int64_t blocks, int batch, cudaStream_t stream) {
  switch (out) {
    case DType::f32: return launch<D, float>(p, blocks, batch, stream);
    case DType::f16: return launch<D, fp16>(p, blocks, batch, stream);
    case DType::bf16: return launch<D, bf16>(p, blocks, batch, stream);
  }
}

}  // namespace

void launch_prefill(const PrefillParams& p, int d, DType out_dtype, int64_t blocks, int batch, cudaStream_t stream) {
  if (d == 64)
    launch_d<64>(p, out_dtype, blocks, batch, stream);
  else if (d == 128)
    launch_d<128>(p, out_dtype, blocks, batch, stream);
  else
    throw Error("the CUDA prefill kernel supports head dims 64 and 128 (got " + std::to_string(d) + ")");
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("prefill kernel launch failed: ") + cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
