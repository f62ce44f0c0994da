// The precision policy: which 128x128 tile pairs are computed in the high format.
#pragma once
#include <string>

#include "dmattn/format.hpp"
#include "dmattn/hd.hpp"

namespace dmattn {

// P.V precision (docs/DESIGN.md): bf16 (P rounded to bf16, V in bf16), mxfp8 (P and V in MXFP8 E4M3,
// 32-blocks along the key dimension) and mxfp4 (P in MXFP8 E4M3, V in
// MXFP4, the same blocks): the V bytes a 4-bit decode would read, to measure its quality cost first.
// fp8 (prefill only): the form Hopper's FP8 wgmma takes without per-block promotion.
// P in E4M3 at one fixed scale 2^-8 (P <= 1; the MX scale of any block holding the row's maximum),
// V in E4M3 with one power-of-two scale per channel over all Nk keys of a (batch, KV head) (the MX
// scale rule applied to the channel's amax). So a masked V value can change the rounding of visible
// ones through its channel's scale, and a KV cache, which cannot know later values, does not take it.
// Accumulation is fp32 in every mode. The CPU backend computes all four; the KV cache and the CUDA
// decode take bf16, mxfp8 and mxfp4; the CUDA prefill bf16 and fp8.
enum class PV : uint8_t { bf16, mxfp8, mxfp4, fp8 };

// The format of V's codes in P.V (P is E4M3 whenever V is not bf16; MX blocks run along the keys;
// fp8's codes are E4M3 with per-channel scales).
inline Format pv_values_format(PV pv) {
  return pv == PV::bf16 ? Format::bf16 : pv == PV::mxfp4 ? Format::mxfp4 : Format::mxfp8_e4m3;
}

// pv = fp8: P is encoded as E4M3(p * 2^kPvFp8Shift) (p in [0, 1]: codes up to 256 <= 448).
inline constexpr int kPvFp8Shift = 8;

inline constexpr int kTile = 128;  // query rows and key rows per tile

// Which tiles' queries smooth_q centres (Policy::smooth_q): none, the high tiles' (the low tiles
// quantize the queries as they are and take no correction), or every tile's.
enum class SmoothQ : uint8_t { off, high, all };

struct Policy {
  Format high = Format::mxfp8_e4m3;
  Format low = Format::mxfp4;
  // The default (docs/QUALITY.md): eight diagonal tiles, the sink tile, smooth_k and the rotation,
  // the lowest perplexity cost measured for its prefill time (+0.61% SmolLM2-135M, +1.07%
  // Gemma-3-270M; the diagonal tile alone, plain(), +15%).
  int diag_tiles = 8;  // key tiles j with |qtile - j| < diag_tiles are high (causal: the diagonal
                       // tile and the diag_tiles - 1 before it; non-causal: a symmetric band)
  int sink_tiles = 1;  // key tiles j < sink_tiles are high
  ScaleRule scale_rule = ScaleRule::ceil;  // measured better than ocp at no cost (docs/QUALITY.md)
  PV pv = PV::bf16;
  // Subtract K's per-channel mean (over the Nk keys of each batch and KV head) before quantizing.
  // Softmax is invariant to it in exact arithmetic (it shifts a row's scores by q.mean(K)); it
  // removes K's channel outliers from the MX blocks (SageAttention's observation). LSE is reported
  // unshifted. The mean spans every key of the call, so a masked key can change the rounding of the
  // visible ones (as pv = fp8's channel scales do); the KV cache takes the mean of its first append.
  bool smooth_k = true;
  // Subtract from Q its per-channel mean mu (over the Nq rows of the call, per batch and head) before
  // quantizing, and add mu.k back to every score in fp32 from the unquantized K: exact in real
  // arithmetic; it removes Q's common part, which holds most of its energy, from the quantized
  // product, and scales K's quantization error by q - mu instead of q. One mean a head makes the
  // correction one value a (head, key), which rides in K's pre-pass. Like smooth_k's, the mean spans
  // the call: a chunk of queries has its own. `high` centres the queries of the high tiles alone
  // (their correction with them), where the high format's error is what is left (docs/QUALITY.md);
  // it needs two tile formats. Prefill only (decode's queries are not smoothed).
  SmoothQ smooth_q = SmoothQ::off;
  // Rotate Q and K by one randomized Hadamard transform along d before quantizing
  // (include/dmattn/rotation.hpp): exact in real arithmetic (QH (KH)^T = Q K^T up to a power-of-two
  // factor folded into the scale); it spreads channel outliers over every block.
  bool rotate = true;
  // The scores of the first sink_keys keys (absolute positions) are computed from the unquantized
  // (rotated, smoothed) q and k in fp32: the attention sink, which takes a large share of many rows'
  // weight, then carries no quantization error.
  int sink_keys = 0;
  // The high tiles take each query row in two terms: its high-format codes, and the residual (the row
  // less those codes' values) rounded to E4M3 at the row's largest block scale. Q then carries about
  // twice the mantissa bits on the tiles whose scores weigh most, and K's rounding is what is left
  // there. Not an exact transform: a finer form of Q. It needs two tile formats. The CPU backend and
  // the KV cache take it.
  bool q_residual = false;

  // Whether the queries of a high (or low) tile are centred by smooth_q.
  DMATTN_HD bool smooths_q(bool high_tile) const {
    return smooth_q == SmoothQ::all || (high_tile && smooth_q == SmoothQ::high);
  }

  // Tile indices are absolute: query tile = floor(position / 128) with the query's position
  // counted as in causal alignment (row r sits at r + Nk - Nq), key tile = key / 128.
  DMATTN_HD bool is_high(int64_t qtile, int64_t ktile) const {
    return (ktile - qtile < diag_tiles && qtile - ktile < diag_tiles) || ktile < sink_tiles;
  }

  // The tile formats and bands given, no transforms (the other fields their defaults).
  static Policy tiles(Format high, Format low, int diag_tiles, int sink_tiles) {
    Policy p;
    p.high = high;
    p.low = low;
    p.diag_tiles = diag_tiles;
    p.sink_tiles = sink_tiles;
    p.smooth_k = p.rotate = false;
    return p;
  }
  // Every tile in format f, no transforms.
  static Policy all(Format f) { return tiles(f, f, 0, 0); }
  // The method as first defined: MXFP8 on the diagonal tile, MXFP4 elsewhere, no transforms. The
  // fastest DMA policy, and the one whose every score depends on its own query and keys alone.
  static Policy plain() { return tiles(Format::mxfp8_e4m3, Format::mxfp4, 1, 0); }
  std::string describe() const;
  // Throws dmattn::Error for settings no backend takes (negative tile or key counts).
  void validate() const;
  // The accuracy transforms turned on, by name ("smooth_k smooth_q rotate sink_keys"); empty if none.
  std::string transforms() const;
};

// is_high(qtile + ktile0, j + ktile0) for the key tiles 0 <= j < tiles of one query tile, in 32-bit
// compares (the CUDA prefill kernel's per-tile test; 64-bit tile arithmetic there cost ~100
// instructions a tile): the diagonal band [lo, hi], clamped to [-1, tiles], and the sink tiles
// j < sinks. qtile and j count from the first key tile, whose absolute index is ktile0 (a block of a
// longer sequence: AttentionOptions::k_offset / 128).
struct HighTiles {
  int lo, hi, sinks;
  DMATTN_HD HighTiles(const Policy& p, int64_t qtile, int tiles, int64_t ktile0 = 0)
      : lo(int(qtile - p.diag_tiles + 1 < -1 ? -1 : qtile - p.diag_tiles + 1)),
        hi(int(qtile + p.diag_tiles - 1 > tiles ? tiles : qtile + p.diag_tiles - 1)),
        sinks(int(p.sink_tiles - ktile0 < 0 ? 0 : p.sink_tiles - ktile0 > tiles ? tiles : p.sink_tiles - ktile0)) {}
  DMATTN_HD bool operator()(int j) const { return (j >= lo && j <= hi) || j < sinks; }
};

std::string_view pv_name(PV p);
PV parse_pv(std::string_view name);
std::string_view smooth_q_name(SmoothQ s);  // "off", "high", "all"
SmoothQ parse_smooth_q(std::string_view name);

}  // namespace dmattn
