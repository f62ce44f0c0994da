// The device KV cache's unit of transfer: one warp block (32 keys) of one page and KV head, stored as a
// contiguous record that is, byte for byte, what the decode kernel's shared-memory stage for that
// block holds. One bulk copy (TMA, cp.async.bulk) then brings a warp its part of a page, issued by one
// lane: the per-lane cp.async path it replaces took ~150 instructions a warp and page (64-bit
// addresses, swizzle arithmetic, ten copies a lane; SASS) in a kernel bound by issued
// instructions. Host and device: the mirror (kv_mirror.cu) packs records with these functions, the
// kernel (decode.cu) reads them with the same ones, and the CPU tests check their properties.
//
// Record of head dim d (NB = d/32 scale blocks a key), V in vbits (16: bf16, 8: E4M3, 4: E2M1):
//   [0, 32d)          K codes: 32 rows of R bytes (R = d/2 for E2M1, else d: one code a byte), placed
//                     at the END of the region (from 32(d - R)), so that K, its scales and V are one
//                     contiguous run whichever format the page has;
//   [32d, 33d)        K's E8M0 scales [32 keys][NB];
//   [33d, ...)        V: bf16 rows [32 keys][d]; or V^T [d][32 keys] E4M3 bytes (keys in vt_position
//                     order) then the block's E8M0 scales [d]; or V^T [d][16 bytes] E2M1 (keys placed
//                     for f16, e2m1x8_f16_pack) then the scales [d].
// K rows and bf16 V rows have their 16-byte chunks swizzled (chunk_swizzle) so the kernel's fragment
// loads fall in distinct shared-memory banks without padding.
#pragma once
#include <cstdint>

#include "dmattn/hd.hpp"

namespace dmattn::cuda {

constexpr int kRecordKeys = 32;  // keys a record (a decode warp's share of a 128-key page)

// The XOR applied to the 16-byte chunk index of row `row` in a row of `chunks` chunks. The patterns
// (tests/test_kv_record.cpp checks each against the kernel's loads):
//  - 8 or more chunks (FP8 K at d = 128, bf16 V): f = 0 2 4 6 1 3 5 7 over row % 8, so that 8 rows'
//    4-byte loads and each half warp's 8-byte loads (4 rows x 2 chunks) hit distinct banks;
//  - 4 chunks (E2M1 K at d = 128, FP8 K at d = 64): 0 0 2 2 1 1 3 3: rows of one parity fill the
//    other half of the 32 banks, and a half warp's rows 0, 2 (and 4, 6) get chunks two apart;
//  - 2 chunks (E2M1 K at d = 64): 0 0 0 0 1 1 1 1: rows r and r + 4 share banks otherwise.
DMATTN_HD constexpr int chunk_swizzle(int chunks, int row) {
  return chunks >= 8 ? ((row & 3) << 1) | ((row >> 2) & 1) : chunks == 4 ? (row & 2) | ((row >> 2) & 1) : (row >> 2) & 1;
}
// Byte offset of byte b of row `row` (`chunks` 16-byte chunks a row) within the row.
DMATTN_HD constexpr int swizzled(int chunks, int row, int b) {
  return (((b >> 4) ^ chunk_swizzle(chunks, row)) << 4) | (b & 15);
}

// Where key k (0..31) of a block sits in a column of the E4M3 V^T: lane t of the mma's B fragment
// reads bytes 8t..8t+7, which must hold keys 2t, 2t+1, 8+2t, 9+2t and the same plus 16 (the keys its
// P fragment holds, see decode/pv.cuh).
DMATTN_HD constexpr int vt_position(int k) {
  const int r = k % 16;
  return 8 * ((r % 8) / 2) + 4 * (k / 16) + (r % 2) + 2 * (r / 8);
}

DMATTN_HD constexpr int record_k_row(int d, bool e2m1) { return e2m1 ? d / 2 : d; }
// Offset of the K codes; the copy of a record starts there.
DMATTN_HD constexpr int record_k(int d, bool e2m1) { return kRecordKeys * (d - record_k_row(d, e2m1)); }
DMATTN_HD constexpr int record_k_scales(int d) { return kRecordKeys * d; }
DMATTN_HD constexpr int record_v(int d) { return kRecordKeys * d + d; }
// V^T's bytes a column (MX V), and V's region: bf16 rows, or V^T then the scales.
DMATTN_HD constexpr int record_vt_row(int vbits) { return vbits == 4 ? 16 : 32; }
DMATTN_HD constexpr int record_v_bytes(int d, int vbits) {
  return vbits == 16 ? kRecordKeys * 2 * d : d * record_vt_row(vbits) + d;
}
DMATTN_HD constexpr int record_bytes(int d, int vbits) { return record_v(d) + record_v_bytes(d, vbits); }

}  // namespace dmattn::cuda
