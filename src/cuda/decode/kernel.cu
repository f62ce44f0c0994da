// Split-KV decode over cache pages on the GPU. One CTA per (split, KV head x row chunk, sequence)
// runs 8 or 16 query rows of one KV head (of the G = Hq/Hkv query heads x Nq new queries: GQA
// packing, so a page is read once per KV head, not once per query head). Each of the CTA's four
// warps owns one 32-key block of every page and streams it through its own stages, a bulk copy
// (TMA) of the block's record (kv_record.hpp) each. Both
// products run on the tensor cores, transposed so the query rows are the mma's N: S^T per 32-wide
// block of d, E2M1 pages on the integer mma (K and q as bytes of twice their values, exact), FP8 and
// FP6 pages as FP8 block dots (sm_90 has no FP8 mma.sync: two f16 mmas on operands widened exactly,
// mma_fp8_block; widening q once per CTA instead saved 1.5% of the instructions and no time),
// scaled by the two E8M0 scales and summed over blocks in order as the CPU oracle does; the
// softmax stays in registers, in base 2 (the page's row maxima are the only thing the warps exchange);
// P (rounded to bf16, as the oracle) times V in bf16 with fp32 accumulation, or with pv = mxfp8 /
// mxfp4 P quantized to MXFP8 per 32 keys (a warp's block) times V's MXFP8 codes (or MXFP4 codes
// placed as f16) as f16 block dots, scaled by P's and V's block scales. A second kernel merges the
// splits by LSE. At Nq = 1 the work per byte is tiny: the page bytes (K at 4.25 or 8.25 bits, V at
// 16, 8.25 or 4.25) set the time, so the kernel's job is to keep enough of them in flight with few
// instructions per byte.
#include "cuda/decode/decode.cuh"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/capabilities.hpp"
#include "cuda/common/buffers.hpp"
#include "cuda/common/head_dims.hpp"
#include "cuda/common/launch.hpp"
#include "cuda/decode/load_q.cuh"
#include "cuda/decode/mask.cuh"
#include "cuda/decode/merge.cuh"
#include "cuda/decode/pages.cuh"
#include "cuda/decode/params.cuh"
#include "cuda/decode/partials.cuh"
#include "cuda/decode/pv.cuh"
#include "cuda/decode/query_transform.cuh"
#include "cuda/decode/scores.cuh"
#include "cuda/decode/smem.cuh"
#include "cuda/decode/softmax.cuh"
#include "cuda/decode/splits.hpp"
#include "cuda/ptx/pdl.cuh"
#include "cuda/ptx/tma.cuh"
#include "dmattn/error.hpp"
#include "dmattn/format.hpp"
#include "dmattn/rotation.hpp"

namespace dmattn::cuda {
namespace decode {

// kStages pages per warp in flight (pages.cuh); two to four CTAs of four warps share an SM (kCtas). Per
// page, each warp: S^T of its 32 keys on the tensor cores (scores.cuh), masked (mask.cuh), the online
// softmax with the rows' maxima exchanged through shared memory (softmax.cuh: the page's one CTA
// barrier), then O^T += V^T.P^T into the warp's own accumulator of all d columns (pv.cuh); at the end the
// warps' accumulators and sums add up into the split's partial (partials.cuh).
template <int D, int kVB, int kNR, int kCtas>
__global__ void __launch_bounds__(kThreads, kCtas) decode_kernel(const Params p) {
  constexpr int MD = D / 16;  // MD tiles of 16 columns of d in O^T
  using S_ = Smem<D, kVB, kNR, kCtas>;
  constexpr int kStages = S_::kStages, kRows = S_::kRows;
  extern __shared__ __align__(128) uint8_t smem[];
  // The merge kernel may launch now (programmatic dependent launch): it waits for this grid's
  // completion itself (griddepcontrol.wait), so only its launch latency overlaps this kernel.
  allow_dependents();
  const int split = blockIdx.x, hk = blockIdx.y / p.chunks, chunk = blockIdx.y % p.chunks, s = blockIdx.z;
  const int r0 = chunk * kRows, rows = min(kRows, p.G * p.Nq - r0);
  // Rows of this CTA: (query head hk*G + (r0+i)/Nq, query (r0+i)%Nq); their q rows are consecutive.
  const int64_t qrow0 = (int64_t(s) * p.Hq + int64_t(hk) * p.G) * p.Nq + r0;

  // Sliding windows in the instances of one or two CTAs an SM: their registers do not fit under three
  // or four (ptxas spilled the four-CTA instance), and the host runs every windowed decode at two, or
  // at one where that is the most the instance fits.
  constexpr bool kWindow = kCtas <= 2;
  // Pages [jlo, np) hold the keys the rows see; this split takes its share of them.
  const int L = p.kv.length_of(s), np = (L + T - 1) / T;
  const int jlo = first_page<kWindow>(L, p.Nq, p.window_left), eff = min(p.splits, np - jlo);
  if (split >= eff) return write_empty_partial<D>(p, qrow0, rows, split);
  const int j0 = jlo + int(int64_t(split) * (np - jlo) / eff), j1 = jlo + int(int64_t(split + 1) * (np - jlo) / eff);

  PageStream<D, kVB, kNR, kCtas> pages(p, smem, s, hk, j0, j1);
  for (int i = 0; i < kStages - 1; ++i) pages.issue(j0 + i, i);
  load_q(p, pages, s, hk, r0, rows);
  const uint32_t* qb = reinterpret_cast<const uint32_t*>(smem + S_::kQb);
  const float* sq = reinterpret_cast<const float*>(smem + S_::kSq);
  const uint8_t* lut = smem + S_::kLut;

  const RowMask<kNR, kWindow> mask(p, L, r0, rows);
  float acc[MD][kNR][4];  // O^T: columns 16md + g (+8) of rows 8nr + 2t (+1), over this warp's keys
#pragma unroll
  for (int md = 0; md < MD; ++md)
#pragma unroll
    for (int nr = 0; nr < kNR; ++nr)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[md][nr][i] = 0.0f;
  PageSoftmax<kNR> softmax;
  float* rmax = reinterpret_cast<float*>(smem + S_::kMax);  // [page parity][warp][row]

  // stage: page j's buffer; fill: page j - 1's (free at j0: the first kStages - 1 pages took the others).
  int stage = 0, fill = kStages - 1;
  uint32_t parity = 0;
  for (int j = j0; j < j1; ++j) {
    pages.wait(stage, parity);  // this warp's record of page j has landed
    __syncwarp();  // and every lane is done with page j - 1's buffer, which the next copy takes
    pages.issue(j + kStages - 1, fill);
    const uint8_t* st = pages.buffer(stage);
    const int sl = pages.slot(stage);
    float sc[2][kNR][4];
    page_scores<D, kNR>(pages.elem_of(sl), sl, st, qb, sq, lut, sc);
    exact_sink_scores<kNR>(p, sc, j, qrow0, rows);
    mask.apply(sc, j);
    float alpha[kNR][2];
    if (softmax.update(sc, rmax, j, p.scale, alpha)) rescale<D, kNR>(acc, alpha);
    accumulate_pv<D, kVB, kNR>(acc, sc, st + record_v(D), p.rule);
    fill = stage;
    if (++stage == kStages) stage = 0, parity ^= 1u;
  }
  __syncthreads();  // every copy was waited for and every warp is done with the stage buffers
  write_partial<D, kVB, kNR, kCtas>(p, smem, acc, softmax, qrow0, rows, split);
}

}  // namespace decode
namespace {

using decode::Params;
using decode::Smem;
using decode::kThreads;
using decode::max_ctas;
using decode::merge_splits;
using decode::transform_queries;

// kCtas CTAs an SM (Smem sizes the stages for it): a block-synchronous kernel measured faster at two
// CTAs than at one CTA with twice the stages, and three faster than two
// for MXFP4 V where the grid fills the GPU (bench/RESULTS.md).
// dependent: launched as the previous kernel's programmatic dependent (the query pre-pass).
template <int D, int kVB, int kNR, int kCtas>
void launch(const Params& p, dim3 grid, cudaStream_t stream, bool dependent) {
  constexpr int bytes = Smem<D, kVB, kNR, kCtas>::kBytes;
  allow_dynamic_smem<decode::decode_kernel<D, kVB, kNR, kCtas>>(bytes);
  launch_kernel(decode::decode_kernel<D, kVB, kNR, kCtas>, grid, dim3(kThreads), bytes, stream, dependent, "decode kernel", p);
}

// One dispatch point for the kernel's instances: head dim x V's bits (16, 8, 4) x rows per CTA (8 or
// 16) x CTAs an SM (up to max_ctas; decode_plan asks for no more).
void launch(const Params& p, dim3 grid, int d, int vbits, int nr, int ctas, cudaStream_t stream, bool dependent) {
  auto go = [&](auto dc, auto vc) {
    constexpr int D = decltype(dc)::value, kVB = decltype(vc)::value;
    constexpr int kMost1 = max_ctas(D, kVB, 1), kMost2 = max_ctas(D, kVB, 2);
    if (nr == 1) {
      if constexpr (kMost1 >= 4)
        if (ctas == 4) return launch<D, kVB, 1, 4>(p, grid, stream, dependent);
      if constexpr (kMost1 >= 3)
        if (ctas == 3) return launch<D, kVB, 1, 3>(p, grid, stream, dependent);
      if constexpr (kMost1 >= 2)
        if (ctas == 2) return launch<D, kVB, 1, 2>(p, grid, stream, dependent);
      launch<D, kVB, 1, 1>(p, grid, stream, dependent);
    } else {
      launch<D, kVB, 2, (kMost2 >= 2 ? 2 : 1)>(p, grid, stream, dependent);
    }
  };
  auto with_v = [&](auto dc) {
    if (vbits == 16)
      go(dc, std::integral_constant<int, 16>{});
    else if (vbits == 8)
      go(dc, std::integral_constant<int, 8>{});
    else
      go(dc, std::integral_constant<int, 4>{});
  };
  with_head_dim(DecodeHeadDims{}, d, "the CUDA decode", with_v);
}

}  // namespace

void decode_paged_async(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                        float scale, int splits, int* nonfinite, cudaStream_t stream, const QueryTransform& qt,
                        int64_t window_left) {
  const int64_t S = kv.S, Hkv = kv.Hkv, d = kv.d, Hq = q.shape[1], Nq = q.shape[2];
  require(cuda_decode_capabilities(), policy, d);
  if (q.device != Device::cuda || out.device != Device::cuda) throw Error("decode: q and out must be CUDA tensors");
  if (q.stride[3] != 1 || out.stride[3] != 1) throw Error("the CUDA decode needs unit stride on the head dimension");
  if (q.shape[0] != S || q.shape[3] != d || Hq % Hkv != 0 || out.shape != q.shape)
    throw Error("decode: q and out must be [S, a multiple of Hkv, Nq, d]");
  const int vbits = v_bits(policy.pv);
  if (!kv.rec || kv.vbits != vbits) throw Error("decode: the pages' records do not hold V in the policy's pv format");
  if (Hkv * (kTile / kRecordKeys) * record_bytes(int(d), vbits) >= (int64_t(1) << 32))
    throw Error("decode: a page's records exceed 4 GiB (too many KV heads)");
  const Format fmt[2] = {policy.high, policy.low};
  Params p{};
  p.kv = kv;
  p.Hq = int(Hq);
  p.Nq = int(Nq);
  p.G = int(Hq / Hkv);
  // Rows per CTA: 8 (one N tile of the mma) when the GQA group's rows fit, else 16 and more chunks.
  const int nr = p.G * p.Nq <= 8 ? 1 : 2;
  p.chunks = (p.G * p.Nq + 8 * nr - 1) / (8 * nr);
  p.rule = policy.scale_rule;
  int dev = 0, sms = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  // DMATTN_DECODE_CTAS=2|3|4 forces the instance (capped at what it fits; the GPU tests run each).
  const char* force = std::getenv("DMATTN_DECODE_CTAS");
  // A sliding window runs at two CTAs an SM (kWindow).
  const int only = window_left >= 0 ? 2 : force && (force[0] >= '2' && force[0] <= '4') ? force[0] - '0' : 0;
  // A sliding window bounds the pages a sequence reads: its Nq rows' windows span at most this many.
  p.window_left = int(window_left < 0 ? INT32_MAX : std::min<int64_t>(window_left, INT32_MAX));
  const int pages = int(std::min<int64_t>(kv.max_pages, (int64_t(p.window_left) + Nq - 1) / kTile + 2));
  const DecodePlan plan = decode_plan(S * Hkv * p.chunks, pages, sms, max_ctas(int(d), vbits, nr), splits, only);
  p.splits = std::min(plan.splits, std::max(1, kv.max_pages));
  Buffers buf(stream);  // stream-ordered: freed after the enqueued work
  const int64_t rows = S * Hq * Nq;
  p.q = q.data;
  p.qdt = q.dtype;
  p.qsb = q.stride[0];
  p.qsh = q.stride[1];
  p.qsn = q.stride[2];
  float* lse_shift = nullptr;
  scale = rotated_scale(scale, int(d), qt.on && qt.rotate);
  // The transforms' query side runs in the kernel's prologue where it is the rotation alone (no sink
  // scores, no LSE shift of smooth_k's to report); else in a pre-pass, whose dependent the kernel is.
  const bool prepass = qt.on && (!qt.rotate || qt.sink_keys > 0 || (qt.smooth_k && lse));
  p.rotate_q = qt.on && !prepass;
  if (prepass) {
    // One scratch allocation: the transformed q (bf16), the sink scores, the LSE shifts.
    const size_t qx_bytes = (size_t(rows * d) * sizeof(uint16_t) + 15) / 16 * 16;
    const size_t sink_floats = size_t(rows * qt.sink_keys), shift_floats = qt.smooth_k ? size_t(rows) : 0;
    uint8_t* scratch = buf.alloc<uint8_t>(qx_bytes + (sink_floats + shift_floats) * sizeof(float));
    uint16_t* qx = reinterpret_cast<uint16_t*>(scratch);
    float* sink = sink_floats ? reinterpret_cast<float*>(scratch + qx_bytes) : nullptr;
    lse_shift = shift_floats ? reinterpret_cast<float*>(scratch + qx_bytes) + sink_floats : nullptr;
    if ((qt.smooth_k || qt.sink_keys > 0) && !qt.state) throw Error("decode: the transforms' state is missing");
    const unsigned blocks = unsigned((rows + 3) / 4);  // four warps a block, a warp a row
    with_typed(q, [&](auto* typed) {
      auto go = [&](auto dc) {
        transform_queries<decltype(dc)::value><<<blocks, 128, 0, stream>>>(
            typed, q.stride[0], q.stride[1], q.stride[2], int(Hq), int(Nq), p.G, rows, qt, kv, scale, qx, sink, lse_shift);
      };
      with_head_dim(DecodeHeadDims{}, d, "the CUDA decode", go);
    });
    check(cudaGetLastError(), "decode query transform");
    p.q = qx;
    p.qdt = DType::bf16;
    p.qsn = d;
    p.qsh = Nq * d;
    p.qsb = Hq * Nq * d;
    p.sink = sink;
    p.sink_keys = qt.sink_keys;
  }
  p.nonfinite = nonfinite;
  for (int sl = 0; sl < 2; ++sl) p.kelem[sl] = format_info(fmt[sl]).elem;
  p.scale = float(double(scale) * 1.4426950408889634);  // base 2 in the kernel, the product rounded once
  p.part = buf.alloc<float>(size_t(rows * p.splits * (d + 2)) * sizeof(float));
  const dim3 grid(unsigned(p.splits), unsigned(Hkv * p.chunks), unsigned(S));
  launch(p, grid, int(d), vbits, nr, plan.ctas_per_sm, stream, prepass);
  check(cudaGetLastError(), "decode kernel");
  const unsigned mblocks = unsigned((rows * (d / 32) + 7) / 8);  // 8 warps a block, a warp per 32 columns of a row
  // Launched as the decode kernel's programmatic dependent: its CTAs are placed while the decode
  // finishes (the decode triggers at its start; merge_splits waits for the decode grid's completion).
  with_typed(out, [&](auto* typed) {
    launch_kernel(merge_splits<std::remove_pointer_t<decltype(typed)>>, dim3(mblocks), dim3(256), 0, stream, true,
                  "merge kernel", static_cast<const float*>(p.part), rows, p.splits, int(d), typed, out.stride[0],
                  out.stride[1], out.stride[2], int(Hq), int(Nq), scale, lse, static_cast<const float*>(lse_shift));
  });
}

void decode_paged(const PagedKV& kv, const Policy& policy, const TensorView& q, const TensorView& out, float* lse,
                  float scale, int splits, cudaStream_t stream, const QueryTransform& qt, int64_t window_left) {
  Buffers buf(stream);
  int* bad = buf.alloc<int>(sizeof(int));
  check(cudaMemsetAsync(bad, 0, sizeof(int), stream), "cudaMemset");
  decode_paged_async(kv, policy, q, out, lse, scale, splits, bad, stream, qt, window_left);
  int bad_host = 0;
  check(cudaMemcpyAsync(&bad_host, bad, sizeof bad_host, cudaMemcpyDeviceToHost, stream), "decode");
  check(cudaStreamSynchronize(stream), "decode");
  if (bad_host) throw Error("decode_attention: q holds a non-finite value");
}

}  // namespace dmattn::cuda
