// The DMA prefill kernel's parameters. Inputs are prepared by prefill/attention.cu: Q and K rows in the
// tensor-core form of each format (FP8 bytes + E8M0 scales, one set per slot: 0 = high, 1 = low;
// scales folded into the codes where exact), V transposed: bf16, or E4M3 with per-channel scales (pv = fp8).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include "core/mask.hpp"
#include "cuda/common/operand.hpp"
#include "cuda/prefill/packing.hpp"
#include "dmattn/format.hpp"
#include "dmattn/policy.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn::cuda {

struct PrefillParams {
  // TMA maps (filled by launch_prefill): K bytes per slot [B*Hkv][Nk][d] (zeros past Nk), V^T [B*Hkv][d][ldv].
  CUtensorMap kmap[2], vmap;
  const uint8_t* q8[2];           // [B*Hq*Nq, d] FP8 bytes
  const uint8_t* qs[2];           // [B*Hq*Nq, d/32] E8M0
  Operand op[2];                  // each slot's tensor-core form (operand_of its format)
  int nslots;                     // 1 when high == low
  // bf16 slots (NVFP4): 16-blocks with E4M3 block scales under one fp32 second scale per row. q8 and
  // k8 then hold bf16 values, each E2M1 value times its block's scale (exact); qten [B*Hq*Nq] Q's
  // second scales; krs K's, with kts 0 (a scale a key); qs and ks unused.
  const float* qten[2];
  const uint8_t* k8[2];  // [B*Hkv*Nk, d]
  const uint8_t* ks[2];  // [B*Hkv, ldv, d/32] (rows padded like krs)
  const float* krs[2];   // [B*Hkv, ldv]: a key's one scale when its blocks share it (else < 0)
  const float* kts[2];   // [B*Hkv, ldv/128] (fold_key_tiles): the tile's one key scale, 0 where each key
                         // has one scale of its own, < 0 where some key keeps several
  const void* vt;        // [B*Hkv, d, ldv]: V transposed, zeros past Nk; bf16 bits, or for pv = fp8 E4M3
                         // bytes whose 32-key blocks hold their keys in pv_fp8_key order
  bool pv_fp8;           // P.V in E4M3 (PV::fp8): vt holds E4M3 bytes, vscale the channel scales
  const float* vscale;   // pv = fp8: [B*Hkv, d], each channel's scale (else null)
  int64_t ldv;           // a multiple of 128 (the key tile)
  void* out;             // [B,Hq,Nq,d], unit stride on d
  int64_t out_sb, out_sh, out_sn;
  bool out_pairs;       // out and its strides keep every even column's pair aligned (two elements a store)
  float* lse;  // [B,Hq,Nq] or null
  int Hq, Hkv;
  int Nq;  // query rows of each (b, h) (packed sequences: all of them)
  int Nk;  // K's rows of each (b, h) in k8 (packed sequences: the padded slots, ldv)
  float scale;
  Mask mask;  // which keys a query sees (causal, sliding window), positions counted from key 0
  Policy policy;
  // Positions count from key 0 (absolute position k_offset, a multiple of 128): query row r sits at
  // q_pos0 + r (default Nk - Nq: bottom-right), and key tile j is absolute tile ktile0 + j.
  int64_t q_pos0, ktile0;
  int64_t first_block;  // the first 128-position block (positions can be negative when Nq > Nk)
  int64_t blocks;       // number of query blocks (the grid's x); packed sequences: of SeqBlocks
  // Accuracy transforms (transform.hpp), in logits (the softmax scale applied): smooth_q's per-key
  // additions ds [B*Hq][ldv] of each query head, and the exact scores sink [B*Hq*Nq][sink_keys] of the
  // leading keys; null / 0 when off.
  const float* ds;
  const float* sink;
  int sink_keys;
  // Packed sequences (null: the batch's B sequences of Nq queries and Nk keys): each CTA's work in
  // the order the grid runs it, and the sequences; B is 1, q_pos0 and ktile0 0. (Last, so the batch's
  // instances read every other field where they did before.)
  const SeqBlock* work;
  const SeqSpan* seqs;
};

// pv = fp8: the wgmma's A fragment of P (E4M3, k = 32 from registers; wgmma.cuh) holds, at logical
// key L of a 32-key block, the S accumulator's column pv_fp8_key(L) (a quad's thread t has columns
// 2t, 2t+1 of every 8 there, and logical keys 4t..4t+3, 16+4t..16+4t+3 in the fragment). V^T stores
// each block's keys in this order, so P's registers go to the tensor cores without a shuffle.
__host__ __device__ constexpr int pv_fp8_key(int L) { return 16 * (L / 16) + 8 * (L % 4 / 2) + 2 * (L % 16 / 4) + L % 2; }

constexpr int kPrefillRows = 128;  // query positions per CTA (8 warps x 16): one query tile

void launch_prefill(const PrefillParams& p, int d, DType out_dtype, int64_t blocks, int batch, cudaStream_t stream);

}  // namespace dmattn::cuda
