// The attention mask, stated once for every backend (the CPU oracle and reference through
// Problem::key_begin/key_end, the CUDA kernels directly): which keys a query sees.
//
// Positions are in the keys' frame: key j sits at position j, a query at position pos. Causal: a
// query sees no key after its own position. A sliding window (left, right) keeps the keys in
// [pos - left, pos + right]; -1 leaves that side unbounded (flash-attn's window_size).
#pragma once
#include <cstdint>

#include "dmattn/hd.hpp"

namespace dmattn {

struct Mask {
  int64_t nk = 0;  // keys
  bool causal = false;
  int64_t left = -1, right = -1;

  // The query sees keys [key_begin(pos), key_end(pos)); key_begin <= key_end.
  DMATTN_HD int64_t key_end(int64_t pos) const {
    int64_t end = causal ? pos + 1 : nk;
    if (right >= 0) end = end < pos + right + 1 ? end : pos + right + 1;
    end = end > 0 ? end : 0;
    return end < nk ? end : nk;
  }
  DMATTN_HD int64_t key_begin(int64_t pos) const {
    if (left < 0) return 0;
    const int64_t begin = pos - left, end = key_end(pos);
    return begin < 0 ? 0 : begin < end ? begin : end;
  }

  // The key tiles (of `tile` keys) [begin, end) that hold every key the positions [pos0, pos0 + rows)
  // see: a tile wholly before a sliding window or after the last key a row sees is not among them.
  // (Fewer than 2^31 tiles: callers keep nk below 2^31.)
  struct Tiles {
    int begin, end;
  };
  DMATTN_HD Tiles key_tiles(int64_t pos0, int64_t rows, int64_t tile) const {
    const int end = int((key_end(pos0 + rows - 1) + tile - 1) / tile);
    const int begin = int(key_begin(pos0) / tile);  // key_begin grows with the position
    return {begin < end ? begin : end, end};
  }
};

}  // namespace dmattn
