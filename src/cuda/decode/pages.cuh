// The decode's producer: each warp streams its own 32 keys of every page of its split (one record,
// kv_record.hpp) through its own kStages buffers, a bulk copy (TMA) a record, signalled by the stage's
// mbarrier, so a warp waits for its own copies only.
#pragma once
#include <cstdint>

#include "cuda/decode/smem.cuh"
#include "cuda/ptx/tma.cuh"

namespace dmattn::cuda::decode {

template <int D, int kVB, int kNR, int kCtas>
struct PageStream {
  using S_ = Smem<D, kVB, kNR, kCtas>;
  static constexpr int kStages = S_::kStages;

  const Params& p;
  uint8_t* smem;
  int warp, lane, j1;
  const int32_t* table;  // the sequence's row of the page table
  // Page ids and formats of the split, 32 pages at a time in the warp's lanes (one a lane), the next 32
  // loaded a window ahead: the two dependent global loads stay off the per-page path.
  int win, cur_pid, cur_sl, nxt_pid, nxt_sl;
  uint32_t ring = 0;  // bit i: the format slot of the page in stage i
  // Both slots' element types in one register: indexing the parameter by a run-time slot is a
  // dependent constant load on every page's path (the prefill measured one such load at 3.5% of its stalls).
  uint32_t kel;
  // This warp's barriers, one a stage: lane 0 announces a record's bytes and issues its bulk copy; the
  // copy's completion flips the barrier's phase. Stages fill in turn, so the parity of the phase that
  // page j's copy completes flips each time the stage index wraps.
  uint64_t* bars;
  // This warp's record of page 0 and the distance between pages' records (< 2^32 bytes: decode_paged_async checks).
  const uint8_t* rec0;
  uint32_t page_stride;

  // Pages [j0, j1) of sequence s, KV head hk.
  __device__ __forceinline__ PageStream(const Params& p_, uint8_t* smem_, int s, int hk, int j0, int j1_)
      : p(p_), smem(smem_), warp(threadIdx.x / 32), lane(threadIdx.x % 32), j1(j1_), table(p_.kv.row(s)), win(j0) {
    load_window(win, cur_pid, cur_sl);
    load_window(win + 32, nxt_pid, nxt_sl);
    kel = uint32_t(p.kelem[0]) | uint32_t(p.kelem[1]) << 8;
    bars = reinterpret_cast<uint64_t*>(smem + S_::kBar) + warp * kStages;
    rec0 = p.kv.rec + (int64_t(hk) * kWarps + warp) * S_::kWarpStage;
    page_stride = uint32_t(p.kv.Hkv) * kWarps * S_::kWarpStage;
    if (lane == 0) {
      for (int i = 0; i < kStages; ++i) tma::init(bars + i, 1);
      tma::fence_init();  // visible to the copy engine
    }
    __syncwarp();
  }

  __device__ __forceinline__ void load_window(int base, int& pid, int& sl) const {
    const int jj = base + lane;
    pid = jj < j1 ? table[jj] : 0;
    sl = jj < j1 ? p.kv.slot[pid] : 0;
  }
  __device__ __forceinline__ Elem elem_of(int sl) const { return Elem((kel >> (8 * sl)) & 0xFF); }
  // This warp's buffer of stage i.
  __device__ __forceinline__ uint8_t* buffer(int i) const { return smem + (i * kWarps + warp) * S_::kWarpStage; }
  // The format slot of the page in stage i.
  __device__ __forceinline__ int slot(int i) const { return (ring >> i) & 1; }

  // This warp's 32 keys of page j (one record) into the buffer of `stage`.
  __device__ __forceinline__ void issue(int j, int stage) {
    if (j >= j1) return;
    if (j == win + 32) {
      win = j;
      cur_pid = nxt_pid;
      cur_sl = nxt_sl;
      load_window(win + 32, nxt_pid, nxt_sl);
    }
    const int pid = __shfl_sync(0xffffffffu, cur_pid, j - win), sl = __shfl_sync(0xffffffffu, cur_sl, j - win);
    ring = (ring & ~(1u << stage)) | uint32_t(sl) << stage;
    // The record from its K codes on: E2M1 rows are half as long and start later in the region.
    const int first = record_k(D, elem_of(sl) == Elem::e2m1);
    if (lane == 0) {
      const uint8_t* src = rec0 + uint64_t(uint32_t(pid)) * page_stride + first;
      tma::arrive_expect(bars + stage, uint32_t(S_::kWarpStage - first));
      tma::load_bytes(buffer(stage) + first, src, uint32_t(S_::kWarpStage - first), bars + stage);
    }
  }

  // Until the copy into `stage` of the phase `parity` has landed.
  __device__ __forceinline__ void wait(int stage, uint32_t parity) const { tma::wait(bars + stage, parity); }
};

}  // namespace dmattn::cuda::decode
