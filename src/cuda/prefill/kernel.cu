// DMA prefill on Hopper's warpgroup tensor cores (wgmma), warp-specialised. One CTA = one
// 128-position query tile (aligned in absolute positions, so one format per key tile; scheduler.cuh
// picks it) x the key tiles its mask reaches (mask.cuh: causal and sliding windows), in ascending
// order, in steps of a tile (half a tile at d = 256: smem.cuh's Tiling). Its shared memory is a ring
// of stages (ring.cuh: every address and barrier). The producer warpgroup (producer.cuh) streams each
// step's K (in its tile's format), key scales and V (bf16, transposed by the pre-pass so both wgmma
// operands are K-major) into it with TMA: 3 stages, or K and V rings of 2 where 3 do not fit (Smem).
// Two consumer warpgroups of 64 query rows each (the body below) load their own Q rows (both formats,
// from the quantize pass) while the first copies are in flight, then take turns on the tensor cores
// at d >= 128 (named barriers): while one runs its softmax, the other's S_j and P_{j-1}.V_{j-1}
// execute (FA3's ping-pong); within a warpgroup P_{j-1}.V_{j-1} is issued with S_j and, in the NVFP4
// split-ring instance only, runs under S_j's softmax (elsewhere that measured slower: see the wait
// after the softmax).
//
// S = Q.K^T per tile with MX scaling (docs/DESIGN.md; scores.cuh). Where every row of the
// warpgroup's Q and every key of the tile carries one scale for all of d (block scales are folded
// into the FP8 codes where that is exact, by the quantize pass), all of d runs as one wgmma chain and
// the row x key scales multiply S once; otherwise one wgmma per 32-wide block, promoted with the
// block scales on the CUDA cores. NVFP4 tiles (16-blocks, E4M3 scales) arrive as bf16 values with
// their block scales folded in (the bf16 Operand) and always run as one bf16 wgmma chain.
// Online softmax in fp32 (softmax.cuh); P rounded to bf16 (registers) times bf16 V (shared memory),
// or with pv = fp8 (kF8V) P in E4M3 times E4M3 V with per-channel scales, one wgmma chain a tile
// into a fresh accumulator that is added to O in fp32 (pv.cuh); O / l and the LSE (epilogue.cuh).
#include <cmath>

#include "cuda/common/buffers.hpp"
#include "cuda/common/head_dims.hpp"
#include "cuda/prefill/epilogue.cuh"
#include "cuda/prefill/load_q.cuh"
#include "cuda/prefill/mask.cuh"
#include "cuda/prefill/params.cuh"
#include "cuda/prefill/producer.cuh"
#include "cuda/prefill/pv.cuh"
#include "cuda/prefill/ring.cuh"
#include "cuda/prefill/scheduler.cuh"
#include "cuda/prefill/scores.cuh"
#include "cuda/prefill/smem.cuh"
#include "cuda/prefill/softmax.cuh"
#include "cuda/ptx/fp8.cuh"
#include "cuda/ptx/mma.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "dmattn/error.hpp"
#include "dmattn/mx_codec.hpp"
#include "dmattn/numeric.hpp"

namespace dmattn::cuda {
namespace prefill {
namespace {

template <int D, class TOut, bool kF8V, bool kNv, bool kFix = false, bool kPacked = false>
__global__ void __launch_bounds__(kThreads, 1) prefill_kernel(const __grid_constant__ PrefillParams p) {
  using S = Smem<D, kF8V, kNv, kFix>;
  constexpr int NB = S::kNb, kStages = S::kStages;
  constexpr int BN = S::BN, kR = kTile / BN;  // keys a step, steps a key tile
  extern __shared__ __align__(1024) uint8_t smem[];
  const Ring<D, kF8V, kNv, kFix> ring{smem};
  if (threadIdx.x == 0 && (__cvta_generic_to_shared(smem) & 1023) != 0) __trap();  // the swizzle needs it

  static_assert(!kPacked || (!kF8V && !kNv && !kFix), "packed sequences take MX tiles and pv = bf16 (cuda::packs)");
  const TileScheduler<kPacked> tile(p);
  const int h = tile.h, b = tile.b, hk = h / (p.Hq / p.Hkv);
  const int64_t off = tile.off();
  const int64_t pos0 = tile.pos0;
  const int64_t qtile = hd::floor_div(pos0, kTile);
  const int nslots = p.nslots;
  const Mask::Tiles kt = key_steps<BN>(tile.mask(), pos0);
  const int steps = kt.end;  // steps [kt.begin, steps); step j lies in key tile j / kR
  const int key0 = tile.key0();  // the sequence's key 0 in K's padded rows
  const int64_t kv_tile0 = (int64_t(b) * p.Hkv + hk) * p.ldv + key0;  // this head's row scales
  const StepSlots<kR> slot_of{HighTiles(p.policy, qtile, (steps + kR - 1) / kR, p.ktile0), nslots};

  ring.init();
  __syncthreads();  // barriers and fold flags initialised

  // The warpgroup's role, through a shuffle so the compiler knows it is uniform across the warp (ptxas
  // serialises wgmmas it believes sit on a divergent path).
  const int wgi = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  if (wgi == 2) {  // producer warpgroup: one thread issues every copy
    wg::regs_dec<24>();
    if (threadIdx.x == kConsumers) produce(p, ring, slot_of, kt, b, h, hk, key0, kv_tile0);
    return;
  }
  wg::regs_inc<240>();
  // Turns on the tensor cores (Tiling<D>::kTurns): warpgroup w issues its GEMMs after barrier 1 + w,
  // then lets the other go. Warpgroup 1 opens warpgroup 0's first turn (before its own Q, which then
  // runs under warpgroup 0's first tile) and skips its last hand-over, so both barriers see as many
  // arrivals as waits.
  constexpr bool kTurns = Tiling<D>::kTurns;
  const int me = 1 + wgi, other = 2 - wgi;
  if (kTurns && wgi == 1 && kt.begin < steps) wg::bar_arrive(1, kConsumers);
  // Each warpgroup brings in its Q rows while the producer's first copies are in flight.
  load_q<D, kF8V, kNv>(p, tile, pos0, off, wgi, ring.q(), ring.q_scales(), ring.q_folded());
  wg::fence_async_smem();       // Q bytes written by st.shared are read by wgmma
  wg::bar_sync(3 + wgi, 128);   // the warpgroup's Q rows, scales and fold flag are ready

  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4,
            t = lane % 4;
  const int row_in_cta = wgi * 64 + warp * 16 + g;  // and +8
  const int64_t pos[2] = {pos0 + row_in_cta, pos0 + row_in_cta + 8};
  const int64_t local[2] = {pos[0] - off, pos[1] - off};  // the rows within the sequence
  const bool valid[2] = {local[0] >= 0 && local[0] < tile.nq(), local[1] >= 0 && local[1] < tile.nq()};
  const int64_t row[2] = {local[0] + tile.row0(), local[1] + tile.row0()};  // within the (b, h) plane
  const RowMask rmask(tile.mask(), pos, valid);

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  OnlineSoftmax<BN> softmax;
  // pv = fp8: the P.V in flight (a fresh accumulator a tile) and the factor o takes before it is
  // added (the alpha of the tile whose P it holds). The shift makes P's E4M3 codes p * 2^8 (the
  // exponent subtracts it: free); l carries it too, so O / l is unchanged and the LSE subtracts it.
  float opv[kF8V ? D / 2 : 1];
  float alpha_pv[2] = {1.0f, 1.0f};
  constexpr float kShift = kF8V ? float(kPvFp8Shift) : 0.0f;
  // bf16 P of the previous tile (a wgmma operand until it retires). Zero before the first tile, whose
  // P.V then adds 0 * V_0 (finite: the pre-pass rejects non-finite V): P.V is issued on every tile, so
  // its commit is never empty. A commit of a group that may be empty (the P.V under `if (j > 0)`) made
  // ptxas append a dummy wgmma to it every tile, and wait<1> then retired P.V together with S_j, so
  // the softmax never ran under P.V; committing inside the `if` made ptxas serialise every wgmma
  // (SASS).
  uint32_t a[kF8V ? BN / 32 : BN / 16][4];
#pragma unroll
  for (int kc = 0; kc < (kF8V ? BN / 32 : BN / 16); ++kc) a[kc][0] = a[kc][1] = a[kc][2] = a[kc][3] = 0u;

  // Key tile j's key scales (kts): one scale for the whole tile (> 0), one a key (0), or several a key
  // (< 0). Read a step ahead: a global load's latency on the loop's critical path cost as much as the
  // tile's softmax.
  const float* kts0 = p.kts[0] + kv_tile0 / kTile;
  const float* kts1 = nslots == 2 ? p.kts[1] + kv_tile0 / kTile : kts0;  // (a select: an indexed pair went to local memory)
  float kts_next = kt.begin < steps ? (slot_of(kt.begin) ? kts1 : kts0)[kt.begin / kR] : 0.0f;
  // Each slot's tensor-core form in registers: indexing the parameter by slot cost a stalled constant
  // load per tile (ncu).
  const Operand op_high = p.op[0], op_low = p.op[1];
  // wgmma descriptors of the warpgroup's Q slots and of stage 0's K and V^T.
  constexpr int kW = KMajorTile<D, BM>::kW;  // (the warpgroup's rows start 64 rows in)
  const wg::Desc dq0 = wg::make_desc<kW>(ring.q() + wgi * 64 * kW), dq1 = dq0 + S::kQSlot, dk0 = wg::make_desc<kW>(ring.k(0)),
                 dv0 = wg::make_desc<128>(ring.vt(0));
  // (stage st: K at dk0 + st * kKStride, V^T at dv0 + st * kVStride)
  // kNv: the bf16 forms' descriptors (128-byte atoms; the warpgroup's rows start 64 rows in).
  const wg::Desc bq0 = wg::make_desc<128>(ring.q() + wgi * 64 * 128), bq1 = bq0 + S::kQSlot, bk0 = wg::make_desc<128>(ring.k(0));
  // Stage st of tile j and the parity of its fill, kept as counters (64-bit j % 3 and j / 3 cost ~40
  // instructions a tile).
  int st = 0, prev = kStages - 1;
  uint32_t phase = 0, prev_phase = 0;
  // P_{j-1}.V_{j-1} (bf16 into o; E4M3 into opv, added to o after it retires); kSplit: once the V of
  // that stage's fill of parity ph has landed.
  auto issue_pv_any = [&](int stage, uint32_t ph) {
    if constexpr (S::kSplit) tma::wait(ring.vfull(stage), ph);
    if constexpr (kF8V)
      issue_pv_fp8<D>(opv, a, dv0 + stage * S::kVStride);
    else
      issue_pv<D>(o, a, dv0 + stage * S::kVStride);
  };
  auto add_pv_result = [&]() {  // the retired P.V's result into o
    if constexpr (!kF8V) {
      wg::pin(o);
    } else {
      wg::pin(opv);
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] = fmaf(o[i], alpha_pv[(i / 2) % 2], opv[i]);
    }
  };
  // After P.V retires (at tile j; the last one at tiles): with kF8V, o = o * alpha(P's tile) + opv in
  // fp32; its A registers (P_{j-1}) were live until here, and tile j-1's stage is released.
  auto finish_pv = [&](int j) {
    add_pv_result();
    wg::pin(a);
    if (j > kt.begin) tma::arrive(S::kSplit ? ring.vempty(prev) : ring.empty(prev));
  };
  for (int j = kt.begin; j < steps; ++j) {
    const int slot = slot_of(j);
    const float kts_j = kts_next;
    if (j + 1 < steps) kts_next = (slot_of(j + 1) ? kts1 : kts0)[(j + 1) / kR];
    const Operand op = slot ? op_low : op_high;
    const bool nv = kNv && op == Operand::bf16;  // one chain always (only the kNv instances carry its code)
    const bool folded = nv || (kts_j >= 0.0f && ring.q_folded()[slot][wgi]);
    // P_{j-1}.V_{j-1}'s V (the first tile's own on the first tile, with P = 0)
    const int pv_stage = j > kt.begin ? prev : st;
    const uint32_t pv_phase = j > kt.begin ? prev_phase : phase;
    const wg::Desc sq = slot ? dq1 : dq0, sk = dk0 + st * S::kKStride;
    const float* sqs = ring.q_scales() + (slot * BM + wgi * 64 + warp * 16 + g) * NB;
    tma::wait(ring.full(st), phase);

    float s[BN / 2];
    // After the scores, logit * log2(e) = s * c[r]: c holds the softmax scale, log2(e) and (folded
    // tiles) the row's Q scale; rows outside the output get 1 so their masked -inf stay -inf.
    float c[2] = {kLog2e, kLog2e};
    if constexpr (kTurns) wg::bar_sync(me, kConsumers);
    // bf16 P.V: S_j, then P_{j-1}.V_{j-1} (retired before or after the softmax: see its wait). kF8V:
    // P_{j-1}.V_{j-1} first, retired (and added to o) while S_j executes: its fresh accumulator
    // live during the softmax as well would need ~250 registers (ptxas spilled at 240).
    if constexpr (kF8V) {
      issue_pv_any(pv_stage, pv_phase);
      wg::commit();
    }
    if (folded) {
      if (nv) {
        if constexpr (kNv) issue_chain<D, Operand::bf16>(s, slot ? bq1 : bq0, bk0 + st * S::kKStride);
      } else if (op == Operand::e5m2)
        issue_chain<D, Operand::e5m2>(s, sq, sk);
      else
        issue_chain<D, Operand::e4m3>(s, sq, sk);
      if constexpr (!kF8V) {
        issue_pv_any(pv_stage, pv_phase);
        wg::commit();
      }
      if (kTurns && (wgi == 0 || j + 1 < steps)) wg::bar_arrive(other, kConsumers);
      if constexpr (kF8V) {
        wg::wait<1>();
        finish_pv(j);
        wg::wait<0>();
      } else {
        wg::wait<1>();
      }
      wg::pin(s);
      // Keys folded to one tile scale (the common MXFP4 case) take it here, in the row factor: no
      // per-key multiply of S (64 FMULs and 16 shared loads a tile).
      const float kf = kts_j > 0.0f ? kts_j : 1.0f;
      c[0] = rmask.sees_any(0) ? p.scale * kLog2e * sqs[0] * kf : 1.0f;
      c[1] = rmask.sees_any(1) ? p.scale * kLog2e * sqs[8 * NB] * kf : 1.0f;
      if (kts_j <= 0.0f) scale_by_keys<BN>(s, ring.key_scales(st), t);
    } else {
      if constexpr (!kF8V) {
        issue_pv_any(pv_stage, pv_phase);
        wg::commit();
      }
      if (kTurns && (wgi == 0 || j + 1 < steps)) wg::bar_arrive(other, kConsumers);
      if constexpr (kF8V) {  // (the blocks' first wait would retire it anyway; opv is free for their partial sums)
        wg::wait<0>();
        finish_pv(j);
      }
      if (op == Operand::e5m2)
        scores_per_block<D, Operand::e5m2>(s, sq, sqs, sk, ring.block_scales(st), p.scale, t);
      else
        scores_per_block<D, Operand::e4m3>(s, sq, sqs, sk, ring.block_scales(st), p.scale, t);  // s: scaled logits
    }
    // kFix: S to logits plus the transforms' parts (c then takes log2(e) alone), on the tiles whose
    // queries smooth_q centres (slot 0 is the high one, or the only one), on the steps holding sink
    // keys (p.sink_keys: the keys from key 0 whose absolute positions are sinks).
    const bool centred = kFix && p.ds && p.policy.smooths_q(slot == 0);
    const bool sinks = kFix && j * BN < p.sink_keys;
    if (kFix && (centred || sinks)) {
      const float u[2] = {folded ? c[0] * (1.0f / kLog2e) : 1.0f, folded ? c[1] * (1.0f / kLog2e) : 1.0f};
      const int64_t bhq = int64_t(b) * p.Hq + h;
      const float* sink0 = sinks ? p.sink + (bhq * p.Nq + (valid[0] ? row[0] : 0)) * p.sink_keys : nullptr;
      const float* sink1 = sinks ? p.sink + (bhq * p.Nq + (valid[1] ? row[1] : 0)) * p.sink_keys : nullptr;
      fix_scores<BN>(s, u, centred ? ring.ds(st) : nullptr, sink0, sink1, j * BN,
                     sinks ? p.sink_keys : 0, t);
      c[0] = c[1] = kLog2e;
    }

    if constexpr (S::kSplit) tma::arrive(ring.empty(st));  // S_j has retired and the key scales are read

    rmask.apply<BN>(s, j * BN, t);
    float alpha[2];
    softmax.update(s, c, kShift, alpha);

    if constexpr (kF8V) {  // o takes alpha_j when P_j.V_j is added (next tile)
      alpha_pv[0] = alpha[0];
      alpha_pv[1] = alpha[1];
    } else {
      // Where ptxas puts the wait for P_{j-1}.V_{j-1} decides whether that P.V runs under the softmax:
      // in the softmax's block it hoists the wait above the exponentials (the P.V retires first); in a
      // block after a branch of its own it stays after them. The MX instances measured 2% faster the
      // first way (d = 64 and 128), the split-ring one (NVFP4, d = 128) 3.4% faster the second
      // (bench/RESULTS.md).
      auto rescale_o = [&] {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i / 2) % 2];
      };
      if constexpr (S::kSplit) {
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
          wg::wait<0>();
          finish_pv(j);
          rescale_o();
        } else {
          wg::wait<0>();
          finish_pv(j);
        }
      } else {
        wg::wait<0>();  // P_{j-1}.V_{j-1} has retired
        finish_pv(j);
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) rescale_o();  // late tiles rarely raise a row's max
      }
    }
    pack_p<kF8V>(s, a);
    prev = st;
    prev_phase = phase;
    phase ^= st == kStages - 1;
    st = st == kStages - 1 ? 0 : st + 1;
  }
  if (kt.begin < steps) {  // the last step's P.V
    issue_pv_any(prev, prev_phase);
    wg::commit();
    wg::wait<0>();
    add_pv_result();
  }

  store_output<D, TOut, kF8V>(p, o, softmax, b, h, hk, row, valid, t);
}

template <int D, class TOut, bool kF8V, bool kNv, bool kFix = false, bool kPacked = false>
void launch(PrefillParams p, int64_t blocks, int batch, cudaStream_t stream) {
  // TMA maps: K bytes [B*Hkv][Nk][D] in boxes of a step's keys x one swizzle atom (zeros past Nk),
  // laid out like KMajorTile; V^T bf16 [B*Hkv][D][ldv] in boxes of 64 keys x D (128-byte rows).
  constexpr int BN = Tiling<D>::kBN;
  const uint64_t bh = uint64_t(batch) * uint64_t(p.Hkv), nk = uint64_t(p.Nk), ldv = uint64_t(p.ldv);
  // (An NVFP4 slot's K: bf16 values in boxes of 64 elements x one tile, D/64 a tile.)
  for (int s = 0; s < 2; ++s)
    if (p.k8[s] && p.op[s] == Operand::bf16)
      p.kmap[s] = tensor_map_3d(p.k8[s], CU_TENSOR_MAP_DATA_TYPE_UINT16, {D, nk, bh}, {2 * D, nk * 2 * D}, {64, BN, 1},
                                CU_TENSOR_MAP_SWIZZLE_128B);
    else if (p.k8[s])
      p.kmap[s] = tensor_map_3d(p.k8[s], CU_TENSOR_MAP_DATA_TYPE_UINT8, {D, nk, bh}, {D, nk * D},
                                {KMajorTile<D, BN>::kW, BN, 1}, Tiling<D>::kKSwizzle);
  // (pv = fp8: E4M3 V^T in boxes of 128 keys x D.)
  if constexpr (kF8V)
    p.vmap = tensor_map_3d(p.vt, CU_TENSOR_MAP_DATA_TYPE_UINT8, {ldv, D, bh}, {ldv, D * ldv}, {BN, D, 1},
                           CU_TENSOR_MAP_SWIZZLE_128B);
  else
    p.vmap = tensor_map_3d(p.vt, CU_TENSOR_MAP_DATA_TYPE_UINT16, {ldv, D, bh}, {ldv * 2, D * ldv * 2}, {64, D, 1},
                           CU_TENSOR_MAP_SWIZZLE_128B);
  constexpr int bytes = Smem<D, kF8V, kNv, kFix>::kBytes;
  constexpr auto kernel = prefill_kernel<D, TOut, kF8V, kNv, kFix, kPacked>;
  allow_dynamic_smem<kernel>(bytes);
  kernel<<<TileScheduler<kPacked>::grid(p, blocks, batch), kThreads, bytes, stream>>>(p);
}

template <int D, bool kF8V, bool kNv, bool kFix = false, bool kPacked = false>
void launch_d(const PrefillParams& p, DType out, int64_t blocks, int batch, cudaStream_t stream) {
  switch (out) {
    case DType::f32: return launch<D, float, kF8V, kNv, kFix, kPacked>(p, blocks, batch, stream);
    case DType::f16: return launch<D, fp16, kF8V, kNv, kFix, kPacked>(p, blocks, batch, stream);
    case DType::bf16: return launch<D, bf16, kF8V, kNv, kFix, kPacked>(p, blocks, batch, stream);
  }
}

template <int D>
void launch_pv(const PrefillParams& p, DType out, int64_t blocks, int batch, cudaStream_t stream) {
  const bool nv = p.op[0] == Operand::bf16 || (p.nslots == 2 && p.op[1] == Operand::bf16);
  if (p.work)  // packed sequences: instances of their own (dma_attention admits only cuda::packs's policies)
    return launch_d<D, false, false, false, true>(p, out, blocks, batch, stream);
  if (p.ds || p.sink_keys > 0) {  // the transforms' instances: MX tiles, bf16 P.V (require_supported)
    if (nv || p.pv_fp8) throw Error("the CUDA prefill applies smooth_q and sink_keys to MX tiles with pv=bf16");
    return launch_d<D, false, false, true>(p, out, blocks, batch, stream);
  }
  if constexpr (!kAllForms<D>) {  // (require_supported says so first)
    if (nv || p.pv_fp8) throw Error("the CUDA prefill at head dim " + std::to_string(D) + " takes MX tiles and pv=bf16");
    return launch_d<D, false, false>(p, out, blocks, batch, stream);
  } else if (p.pv_fp8) {
    nv ? launch_d<D, true, true>(p, out, blocks, batch, stream) : launch_d<D, true, false>(p, out, blocks, batch, stream);
  } else {
    nv ? launch_d<D, false, true>(p, out, blocks, batch, stream) : launch_d<D, false, false>(p, out, blocks, batch, stream);
  }
}

}  // namespace
}  // namespace prefill

void launch_prefill(const PrefillParams& p, int d, DType out_dtype, int64_t blocks, int batch, cudaStream_t stream) {
  with_head_dim(PrefillHeadDims{}, d, "the CUDA prefill kernel",
                [&](auto dc) { prefill::launch_pv<decltype(dc)::value>(p, out_dtype, blocks, batch, stream); });
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("prefill kernel launch failed: ") + cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
