// The CUDA backend: input checks on the device, the quantize pre-pass (Q and K in both formats, V to
// bf16 or, for pv = fp8, E4M3 with per-channel scales), the prefill kernel, for a batch or for packed
// sequences in one call (packing.hpp); and staging of host tensors for callers that hold them there.
#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/capabilities.hpp"
#include "cuda/common/buffers.hpp"
#include "cuda/ptx/fp8.cuh"
#include "cuda/common/head_dims.hpp"
#include "cuda/prefill/packing.hpp"
#include "cuda/prefill/params.cuh"
#include "cuda/prepass/quantize.hpp"
#include "cuda/prepass/transform.hpp"
#include "dmattn/rotation.hpp"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"
#include "problem.hpp"

namespace dmattn {
namespace cuda {
namespace {

// V [B,H,N,d] (any strides) -> V^T [B*H, d, ldv] with zeros for keys N..ldv-1, through a 32x32
// shared tile so reads (along d) and writes (along keys) are both coalesced; flags non-finite
// values. kFp8 = false: bf16 bits. kFp8: E4M3 bytes under each channel's scale (from amax_bits, the
// channel's amax as float bits: v_amax_kernel), keys in pv_fp8_key order; the scales go to vscale.
template <class T, bool kFp8, bool kSlots = false>
__global__ void transpose_v_kernel(const T* v, Shape shape, Shape stride, int64_t ldv, void* vt, int* nonfinite,
                                   const uint32_t* amax_bits, ScaleRule rule, float* vscale, const int32_t* slot_key) {
  __shared__ float tile[32][33];
  const int64_t bh = blockIdx.z, key0 = int64_t(blockIdx.x) * 32, dim0 = int64_t(blockIdx.y) * 32;
  const T* base = v + (bh / shape[1]) * stride[0] + (bh % shape[1]) * stride[1];
  bool bad = false;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t key = kSlots ? slot_key[key0 + r] : key0 + r;
    const float x = (!kSlots || key >= 0) && key < shape[2] ? to_float(base[key * stride[2] + (dim0 + threadIdx.x) * stride[3]]) : 0.0f;
    bad |= !hd::is_finite(x);
    tile[r][threadIdx.x] = x;
  }
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t row = (bh * shape[3] + dim0 + r) * ldv + key0 + threadIdx.x;
    if constexpr (kFp8) {
      const uint8_t sc = choose_e8m0(__uint_as_float(amax_bits[bh * shape[3] + dim0 + r]), Elem::e4m3, rule);
      static_cast<uint8_t*>(vt)[row] = fp8_encode<false>(tile[pv_fp8_key(threadIdx.x)][r] * inverse_e8m0(sc));
      if (blockIdx.x == 0 && threadIdx.x == 0) vscale[bh * shape[3] + dim0 + r] = decode_e8m0(sc);
    } else {
      static_cast<uint16_t*>(vt)[row] = to_bf16(tile[threadIdx.x][r]).bits;
    }
  }
  if (__any_sync(0xffffffffu, bad) && threadIdx.x == 0) atomicOr(nonfinite, 1);
}

// The common case of the bf16 transpose, 16-bit V whose rows are 16-byte aligned: a 64-key x 64-channel
// tile a block, 16-byte loads along channels and 16-byte stores along keys (the generic kernel above
// moves 2 bytes a load and store and was ~4x below the copy bandwidth: 17 us for 8 MB at N = 4096).
// fp16 values are rounded to bf16 as to_bf16 does; flags non-finite values.
template <class T, bool kSlots = false>
__global__ void __launch_bounds__(256) transpose_v_vec_kernel(const T* v, Shape shape, Shape stride, int64_t ldv,
                                                              uint16_t* vt, int* nonfinite, const int32_t* slot_key) {
  constexpr int kPitch = 66;  // channels' rows of 64 keys, padded: the transposing 2-byte stores spread over banks
  __shared__ uint16_t tile[64 * kPitch];
  const int64_t bh = blockIdx.z, key0 = int64_t(blockIdx.x) * 64, dim0 = int64_t(blockIdx.y) * 64;
  const T* base = v + (bh / shape[1]) * stride[0] + (bh % shape[1]) * stride[1] + dim0;
  const int tid = threadIdx.x;
  uint4 w[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {  // key row tid / 8 + 32u, channels 8 (tid % 8) ..
    const int64_t slot = key0 + tid / 8 + 32 * u, key = kSlots ? slot_key[slot] : slot;
    w[u] = (!kSlots || key >= 0) && key < shape[2] ? *reinterpret_cast<const uint4*>(base + key * stride[2] + (tid % 8) * 8) : make_uint4(0, 0, 0, 0);
  }
  bool bad = false;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const uint32_t x[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint16_t h = uint16_t(x[e / 2] >> (16 * (e % 2)));
      uint16_t b;
      if constexpr (std::is_same_v<T, bf16>) {
        b = h;
        bad |= (h & 0x7F80u) == 0x7F80u;
      } else {
        b = to_bf16(to_float(fp16{h})).bits;
        bad |= (h & 0x7C00u) == 0x7C00u;
      }
      tile[((tid % 8) * 8 + e) * kPitch + tid / 8 + 32 * u] = b;
    }
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < 2; ++u) {  // channel tid / 8 + 32u, keys 8 (tid % 8) ..
    const int c = tid / 8 + 32 * u, k = (tid % 8) * 8;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(tile + c * kPitch + k);
    *reinterpret_cast<uint4*>(vt + (bh * shape[3] + dim0 + c) * ldv + key0 + k) = make_uint4(src[0], src[1], src[2], src[3]);
  }
  if (__any_sync(0xffffffffu, bad) && tid % 32 == 0) atomicOr(nonfinite, 1);
}

// Each (b*h, channel)'s largest |V| over the keys, as float bits (non-negative floats order like
// their bits): a block takes 32 channels x kKeys keys, each thread kKeys / 8 of them with every load
// issued before the max (a loop of dependent loads cost 0.1 ms at N = 4096), then one atomicMax a
// channel.
template <class T>
__global__ void v_amax_kernel(const T* v, Shape shape, Shape stride, uint32_t* amax_bits) {
  constexpr int kKeys = 64, kPer = kKeys / 8;
  __shared__ uint32_t part[8][32];
  const int64_t bh = blockIdx.z, key0 = int64_t(blockIdx.x) * kKeys, dim = int64_t(blockIdx.y) * 32 + threadIdx.x;
  const T* base = v + (bh / shape[1]) * stride[0] + (bh % shape[1]) * stride[1] + dim * stride[3];
  float x[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t key = key0 + threadIdx.y + 8 * i;
    x[i] = key < shape[2] ? to_float(base[key * stride[2]]) : 0.0f;
  }
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) m = max(m, __float_as_uint(x[i]) & 0x7FFFFFFFu);
  part[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.y == 0) {
#pragma unroll
    for (int y = 1; y < 8; ++y) m = max(m, part[y][threadIdx.x]);
    atomicMax(amax_bits + bh * shape[3] + dim, m);
  }
}

// V^T for the P.V tensor-core operand (bf16, or pv = fp8's E4M3 with vscale); flags non-finite values.
// slot_key (packed sequences, bf16): column c of V^T holds key slot_key[c] (-1: zeros).
void transpose_v(const TensorView& v, int64_t ldv, void* vt, int* flag, bool fp8, ScaleRule rule, uint32_t* amax,
                 float* vscale, cudaStream_t stream, const int32_t* slot_key = nullptr) {
  const int64_t bh = v.shape[0] * v.shape[1];
  const dim3 grid(unsigned(ldv / 32), unsigned(v.shape[3] / 32), unsigned(bh)), block(32, 8);
  with_typed(v, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    if (fp8) {
      check(cudaMemsetAsync(amax, 0, size_t(bh * v.shape[3]) * sizeof(uint32_t), stream), "cudaMemset");
      const dim3 agrid(unsigned((v.shape[2] + 63) / 64), unsigned(v.shape[3] / 32), unsigned(bh));
      v_amax_kernel<T><<<agrid, block, 0, stream>>>(typed, v.shape, v.stride, amax);
      transpose_v_kernel<T, true><<<grid, block, 0, stream>>>(typed, v.shape, v.stride, ldv, vt, flag, amax, rule, vscale,
                                                              nullptr);
    } else if (sizeof(T) == 2 && rows_16byte_aligned(v) && v.shape[3] % 64 == 0) {
      if constexpr (sizeof(T) == 2) {  // (the f32 instance is never launched: no vector kernel for it)
        const dim3 vgrid(unsigned(ldv / 64), unsigned(v.shape[3] / 64), unsigned(bh));
        auto* out = static_cast<uint16_t*>(vt);
        if (slot_key)
          transpose_v_vec_kernel<T, true><<<vgrid, 256, 0, stream>>>(typed, v.shape, v.stride, ldv, out, flag, slot_key);
        else
          transpose_v_vec_kernel<T><<<vgrid, 256, 0, stream>>>(typed, v.shape, v.stride, ldv, out, flag, nullptr);
      }
    } else {
      if (slot_key)
        transpose_v_kernel<T, false, true><<<grid, block, 0, stream>>>(typed, v.shape, v.stride, ldv, vt, flag, nullptr, rule,
                                                                       nullptr, slot_key);
      else
        transpose_v_kernel<T, false><<<grid, block, 0, stream>>>(typed, v.shape, v.stride, ldv, vt, flag, nullptr, rule, nullptr,
                                                                 nullptr);
    }
  });
  check(cudaGetLastError(), "transpose kernel");
}

void require_supported(const Problem& p) {
  // The kernels are built for sm_90a only: say so on any other GPU rather than fail obscurely.
  int dev = 0, major = 0, minor = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
  if (major != 9)
    throw Error("the CUDA backend is built for Hopper (sm_90a); this GPU is sm_" + std::to_string(major) +
                std::to_string(minor) + ": the CPU backend computes every call (CPU tensors)");
  require(cuda_prefill_capabilities(), p.policy, p.d);
  for (const TensorView* t : {&p.q, &p.k, &p.v, &p.out})
    if (t->stride[3] != 1) throw Error("the CUDA backend needs unit stride on the head dimension");
  const char* names[4] = {"Q", "K", "V", "out"};
  const TensorView* views[4] = {&p.q, &p.k, &p.v, &p.out};
  for (int i = 0; i < 4; ++i)
    if (!is_device_pointer(views[i]->data))
      throw Error(std::string(names[i]) + " is marked as a CUDA tensor but is not device memory");
  if (p.lse && !is_device_pointer(p.lse)) throw Error("lse must be device memory for the CUDA backend");
  if (p.Nq > INT32_MAX || p.Nk > INT32_MAX || p.Hq > 65535 || p.B > 65535 || p.B * p.Hkv > 65535)
    throw Error("problem too large for the CUDA grid");
}

}  // namespace

bool packs(const Problem& p) {
  // The pre-pass's K form for packed sequences (PackedRows) is the default's pair, from 16-bit rows.
  const Policy& pol = p.policy;
  return p.B == 1 && pol.high == Format::mxfp8_e4m3 && pol.low == Format::mxfp4 && pol.pv == PV::bf16 &&
         pol.smooth_q == SmoothQ::off && pol.sink_keys == 0 && dtype_size(p.q.dtype) == 2 && p.k.dtype == p.q.dtype && p.v.dtype == p.q.dtype;
}

void dma_attention(const Problem& call, const Packing* packing) {
  require_supported(call);
  if (packing && !packs(call))
    throw Error("packed sequences in one CUDA call: one packed batch of 16-bit tensors, MXFP8-E4M3 and MXFP4 tiles, "
                "pv=bf16, no smooth_q or sink_keys");
  // Packed sequences: positions count within each sequence (the work list says where each starts).
  Problem p = call;
  if (packing) p.q_pos0 = p.k_pos0 = 0;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  Buffers buf(stream);
  PackedMaps pk;
  if (packing) pk = packing->on(buf.upload(packing->words.data(), packing->words.size()));
  const PackedMaps* packed = packing ? &pk : nullptr;
  const int nslots = p.policy.high == p.policy.low ? 1 : 2;
  const int64_t d = p.d;
  // K's padded rows a head (its keys rounded up to whole tiles, or packed sequences' slots), and the
  // rows of its FP8 codes: the keys, or for packed sequences the slots.
  const int64_t ldv = packing ? pk.ldv : (p.Nk + kTile - 1) / kTile * kTile;
  const int64_t k_code_rows = packing ? ldv : p.Nk;
  const int64_t k_tiles = p.B * p.Hkv * (ldv / kTile), k_pad_rows = p.B * p.Hkv * ldv;
  // The pre-pass's zero-initialised scratch under one memset: the NaN/Inf flags of Q, K, V (16 bytes),
  // then per slot K's row scales (zeros past Nk) and tile-split flags, each slot 16-byte aligned (the
  // kernel's bulk copies of row scales need it).
  const int64_t slot_words = (k_pad_rows + k_tiles + 3) / 4 * 4;
  const size_t zeroed = 16 + size_t(nslots * slot_words) * 4;
  const bool pv_fp8 = p.policy.pv == PV::fp8;
  const Format fmt[2] = {p.policy.high, p.policy.low};
  const int64_t q_rows = p.B * p.Hq * p.Nq, k_rows = p.B * p.Hkv * p.Nk, nb = d / 32;
  // Every scratch buffer is carved from one allocation (Carve). NVFP4 slots hold bf16 values (the
  // E4M3 block scales folded in: no block-scale buffers) and Q's per-row second scales (K's go to krs).
  struct SlotScratch {
    uint8_t *q8, *qs, *k8, *ks;
    float *kts, *qten;
  } sl[2]{};
  uint8_t* zero = nullptr;
  void* vt = nullptr;
  uint32_t* vamax = nullptr;
  float* vscale = nullptr;
  auto carve = [&](uintptr_t base) {
    Carve c(base);
    zero = c.take<uint8_t>(zeroed);
    vt = c.take<uint8_t>(size_t(p.B * p.Hkv * d * ldv) * (pv_fp8 ? 1 : 2));
    if (pv_fp8) {
      vamax = c.take<uint32_t>(size_t(p.B * p.Hkv * d) * sizeof(uint32_t));
      vscale = c.take<float>(size_t(p.B * p.Hkv * d) * sizeof(float));
    }
    for (int s = 0; s < nslots; ++s) {
      const bool nv = operand_of(fmt[s]) == Operand::bf16;
      const size_t bytes = nv ? 2 : 1;
      SlotScratch& x = sl[s];
      x.q8 = c.take<uint8_t>(size_t(q_rows * d) * bytes);
      x.k8 = c.take<uint8_t>(size_t(p.B * p.Hkv * k_code_rows * d) * bytes);
      x.kts = c.take<float>(size_t(k_tiles) * sizeof(float));  // per key tile (PrefillParams::kts)
      if (nv) {
        x.qten = c.take<float>(size_t(q_rows) * sizeof(float));
      } else {
        x.qs = c.take<uint8_t>(size_t(q_rows * nb));
        x.ks = c.take<uint8_t>(size_t(k_pad_rows * nb));  // padded rows (see QuantTarget)
      }
    }
    return c.size();
  };
  carve(reinterpret_cast<uintptr_t>(buf.alloc<uint8_t>(carve(0))));
  check(cudaMemsetAsync(zero, 0, zeroed, stream), "cudaMemset");
  int* flags = reinterpret_cast<int*>(zero);

  // The accuracy transforms: Q and K rotated and smoothed into bf16 rows, which the quantize pass
  // then reads instead of the inputs.
  const Policy& pol = p.policy;
  const bool transformed = !pol.transforms().empty();
  const float scale = rotated_scale(p.scale, int(d), pol.rotate);
  Transformed tf;
  TensorView q_in = p.q, k_in = p.k;
  // Fast path: rotate, smooth_k and smooth_q with MX tiles need no rows of their own: the quantize
  // pass rotates and centres each row as it reads it (RowTransform); the means come first.
  const bool any_nv = operand_of(fmt[0]) == Operand::bf16 || operand_of(fmt[nslots - 1]) == Operand::bf16;
  const bool fused = transformed && pol.sink_keys == 0 && !any_nv;
  RowTransform q_tf, k_tf;
  if (transformed) query_tiles(p, tf.qtile0, tf.qtiles);
  if (pol.smooth_k) {  // the key mean (fused: on K's side stream, ahead of K's quantize below)
    tf.k_part = buf.alloc<double>(size_t(p.B * p.Hkv * (ldv / kTile) * d) * 8);
    tf.kmean = buf.alloc<float>(size_t((packing ? pk.nseq : p.B) * p.Hkv * d) * 4);
    if (p.lse) tf.lse_shift = buf.alloc<float>(size_t(q_rows) * 4);
  }
  const bool smooth_q = pol.smooth_q != SmoothQ::off, split_q = pol.smooth_q == SmoothQ::high;
  if (smooth_q) {  // the query mean (fused: on the caller's stream, ahead of Q's pass below)
    tf.q_part = buf.alloc<double>(size_t(p.B * p.Hq * ((p.Nq + kTile - 1) / kTile) * d) * 8);
    tf.qmean = buf.alloc<float>(size_t(p.B * p.Hq * d) * 4);
    tf.ds = buf.alloc<float>(size_t(p.B * p.Hq * ldv) * 4);
  }
  if (fused) {
    q_tf = {true, pol.rotate, tf.qmean, split_q};
    k_tf = {true, pol.rotate, tf.kmean};
  } else if (transformed) {
    tf.sink_keys = int(std::min<int64_t>(std::max<int64_t>(pol.sink_keys - p.k_pos0, 0), p.Nk));
    tf.q = buf.alloc<uint16_t>(size_t(q_rows * d) * 2);
    tf.k = buf.alloc<uint16_t>(size_t(k_rows * d) * 2);
    if (split_q) tf.q_plain = buf.alloc<uint16_t>(size_t(q_rows * d) * 2);
    if (tf.sink_keys > 0) tf.sink = buf.alloc<float>(size_t(q_rows * tf.sink_keys) * 4);
    transform_qk(p, tf, scale, stream);
    q_in = TensorView::contiguous(tf.q, DType::bf16, p.q.shape, Device::cuda);
    k_in = TensorView::contiguous(tf.k, DType::bf16, p.k.shape, Device::cuda);
  }
  // The rows each slot's Q is quantized from (smooth_q=high: the high slot's centred, the low slot's
  // not; fused, one pass applies the mean to its first target alone).
  TensorView q_slot[2] = {q_in, q_in};
  if (split_q && !fused) q_slot[1] = TensorView::contiguous(tf.q_plain, DType::bf16, p.q.shape, Device::cuda);

  PrefillParams pp{};
  // MX slots go through quantize_rows (both in one pass where both are MX) and fold_key_tiles; NVFP4
  // slots through quantize_rows_nvfp4, as bf16 values with the block scales folded in and each row's
  // second scale beside them (K's in krs, its tiles marked "a scale a key").
  QuantTarget qt[2], kt[2];
  Nvfp4Target qn[2], kn[2];
  KeyFold folds[2];
  int mx[2], n_mx = 0;
  for (int s = 0; s < nslots; ++s) {
    const SlotScratch& x = sl[s];
    pp.op[s] = operand_of(fmt[s]);
    const bool nv = pp.op[s] == Operand::bf16;
    float* krs = reinterpret_cast<float*>(zero + 16) + s * slot_words;  // K's row scales (NVFP4: second scales)
    int* ksplit = reinterpret_cast<int*>(krs + k_pad_rows);
    pp.q8[s] = x.q8;
    pp.qs[s] = x.qs;
    pp.krs[s] = krs;
    // per key tile: its one key scale, 0 or -1 (fold_key_tiles); 0 for NVFP4 (each key its own)
    pp.kts[s] = x.kts;
    pp.k8[s] = x.k8;
    pp.ks[s] = x.ks;
    if (nv) {
      qn[s] = {reinterpret_cast<uint16_t*>(x.q8), nullptr, p.Nq, x.qten, nullptr};
      kn[s] = {reinterpret_cast<uint16_t*>(x.k8), nullptr, ldv, krs, x.kts};  // keys' scales into krs, tiles 0
      pp.qten[s] = x.qten;
    } else {
      qt[s] = {fmt[s], x.q8, x.qs, true, true};
      kt[s] = {fmt[s], x.k8, x.ks, true, true, krs, ldv, ksplit};
      // MXFP8 rows fold where a shifted value rounds too (QuantTarget::round_fold): one MMA chain a tile.
      qt[s].round_fold = kt[s].round_fold = true;
      folds[n_mx] = {x.k8, x.ks, krs, ksplit, x.kts, pp.op[s] == Operand::e5m2};
      mx[n_mx++] = s;
    }
  }
  // The pre-pass's three independent jobs run concurrently: Q (the largest) on the caller's stream, K
  // and its tile fold on one side stream, V (the shortest) on the other; the prefill waits for all three.
  // Enqueued longest first: each launch takes the host ~4 us, and the device starts each job as it
  // arrives (measured: 38 us of host time from the call's start to the prefill's launch at N = 4096,
  // where the pre-pass takes ~30 us on the device). The quantize pass reads every element
  // of Q and K once and flags NaN/Inf on the way. (Q quantized inside the prefill kernel instead was
  // 5-12% slower at N = 16384: bench/RESULTS.md.)
  StreamFork fork(stream);
  if (fused && smooth_q) {  // Q's pass (after it on this stream) and K's dots (on K's side stream) take it
    query_means(p, tf.q_part, tf.qmean, stream);
    fork.mark();
  }
  if (n_mx == 2 && q_slot[mx[0]].data != q_slot[mx[1]].data) {  // each slot from its own rows
    for (int i = 0; i < 2; ++i) quantize_rows(q_slot[mx[i]], p.policy.scale_rule, qt[mx[i]], QuantTarget{}, stream, flags);
  } else if (n_mx > 0) {
    quantize_rows(q_in, p.policy.scale_rule, qt[mx[0]], n_mx == 2 ? qt[mx[1]] : QuantTarget{}, stream, flags, q_tf);
  }
  for (int s = 0; s < nslots; ++s)
    if (pp.op[s] == Operand::bf16) quantize_rows_nvfp4(q_slot[s], qn[s], stream, flags);
  if (fused && pol.smooth_k) {
    key_means(p, tf.k_part, tf.kmean, fork.side(1), packed);
    if (tf.lse_shift)
      lse_shifts(p, tf.kmean, scale, tf.qtile0, tf.qtiles, tf.lse_shift, fork.side(1), packing ? pk.query_seq : nullptr);
  }
  if (n_mx > 0) {
    // Packed sequences: each sequence's keys into slots of their own (padding slots keep zero row
    // scales, and the mask drops their scores), less their sequence's mean.
    const PackedRows k_rows_packed = packing ? PackedRows{pk.key_slot, pk.key_seq, int(p.Hkv)} : PackedRows{};
    quantize_rows(k_in, p.policy.scale_rule, kt[mx[0]], n_mx == 2 ? kt[mx[1]] : QuantTarget{}, fork.side(1), flags + 1,
                  k_tf, k_rows_packed);
    // one scale per key tile where exact (always for MXFP4 keys within 2^8)
    fold_key_tiles(folds, n_mx, p.B * p.Hkv, k_code_rows, ldv, d, fork.side(1));
  }
  if (fused && smooth_q) {
    fork.side_waits_mark(1);
    key_dots(p, tf.kmean, tf.qmean, scale, tf.ds, fork.side(1));
  }
  for (int s = 0; s < nslots; ++s)
    if (pp.op[s] == Operand::bf16) quantize_rows_nvfp4(k_in, kn[s], fork.side(1), flags + 1);
  transpose_v(p.v, ldv, vt, flags + 2, pv_fp8, p.policy.scale_rule, vamax, vscale, fork.side(0),
              packing ? pk.slot_key : nullptr);
  fork.join();
  // The flags are final once the pre-pass is: their read-back goes behind it, and the prefill kernel is
  // enqueued before the host waits for them, so the wait overlaps the kernel (the caller's next launches
  // then overlap it too) instead of following it (measured: 0.374 against 0.331 ms unchecked at N=4096).
  std::optional<FlagReadback> readback;
  if (p.check_finite) readback.emplace(flags, 3, stream);
  pp.nslots = nslots;

  pp.vt = vt;
  pp.pv_fp8 = pv_fp8;
  pp.vscale = vscale;
  pp.ldv = ldv;
  pp.out = p.out.data;
  pp.out_sb = p.out.stride[0];
  pp.out_sh = p.out.stride[1];
  pp.out_sn = p.out.stride[2];
  pp.out_pairs = reinterpret_cast<uintptr_t>(p.out.data) % (2 * dtype_size(p.out.dtype)) == 0 && p.out.stride[0] % 2 == 0 &&
                 p.out.stride[1] % 2 == 0 && p.out.stride[2] % 2 == 0;
  pp.lse = p.lse;
  pp.Hq = int(p.Hq);
  pp.Hkv = int(p.Hkv);
  pp.Nq = int(p.Nq);
  pp.Nk = int(k_code_rows);
  pp.scale = scale;
  pp.ds = tf.ds;
  pp.sink = tf.sink;
  pp.sink_keys = tf.sink_keys;
  pp.mask = p.mask();
  pp.policy = p.policy;
  pp.q_pos0 = p.q_pos0 - p.k_pos0;  // from key 0 (Problem's are absolute)
  pp.ktile0 = p.k_pos0 / kTile;
  static_assert(kPrefillRows == kTile, "a CTA's query block is one query tile");
  if (packing) {  // the work list's items (the batch's: its query tiles)
    pp.work = pk.work;
    pp.seqs = pk.seqs;
    pp.first_block = 0;
    pp.blocks = pk.works;
  } else {
    query_tiles(p, pp.first_block, pp.blocks);
  }
  if (pp.blocks > 0) launch_prefill(pp, int(d), p.out.dtype, pp.blocks, int(p.B), stream);
  if (tf.lse_shift) add_lse_shift(p.lse, tf.lse_shift, q_rows, stream);
  if (!readback) return;  // stream-ordered: the scratch buffers are freed after the work
  const int* bad = readback->wait();  // the one host wait: until the pre-pass is done, not the kernel
  const char* names[3] = {"Q", "K", "V"};
  for (int i = 0; i < 3; ++i)
    if (bad[i]) throw Error(std::string(names[i]) + " holds a non-finite value");
}

void dma_attention_lse_rows(Problem p, float* dst, int64_t stride) {
  if (!is_device_pointer(dst)) throw Error("lse must be device memory for the CUDA backend");
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  Buffers buf(stream);  // stream-ordered: freed after the copy below
  const int64_t rows = p.B * p.Hq;
  p.lse = buf.alloc<float>(size_t(rows * p.Nq) * sizeof(float));
  dma_attention(p);
  check(cudaMemcpy2DAsync(dst, size_t(stride) * sizeof(float), p.lse, size_t(p.Nq) * sizeof(float),
                          size_t(p.Nq) * sizeof(float), size_t(rows), cudaMemcpyDeviceToDevice, stream),
        "lse rows");
}

}  // namespace cuda

bool cuda_device_available() {
  int devices = 0;
  const bool ok = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  cudaGetLastError();  // a machine without a driver leaves an error behind
  return ok;
}

double attention_on_device(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                           float* lse, const AttentionOptions& opts) {
  cuda::require_device();
  cuda::Buffers buf;
  const char* who = "attention_on_device";
  const TensorView dq = buf.stage(q, who), dk = buf.stage(k, who), dv = buf.stage(v, who), dout = buf.stage(out, who);
  const size_t rows = size_t(q.shape[0] * q.shape[1] * q.shape[2]);
  float* dlse = lse ? buf.alloc<float>(rows * sizeof(float)) : nullptr;
  AttentionOptions o = opts;
  o.backend = Backend::cuda;
  o.stream = nullptr;  // the default stream, which time_ms times and the blocking downloads follow
  const float ms = cuda::time_ms([&] { attention(dq, dk, dv, dout, dlse, o); });
  cuda::download(out.data, dout.data, size_t(out.numel()) * dtype_size(out.dtype));
  if (lse) cuda::download(lse, dlse, rows * sizeof(float));
  return ms;
}


}  // namespace dmattn
