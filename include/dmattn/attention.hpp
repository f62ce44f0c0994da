// attention(): the one entry point. Validates, then dispatches to a backend by where tensors live.
//
// Semantics (docs/DESIGN.md, made precise here so that every backend computes the same numbers):
//  - Q [B,Hq,Nq,d], K and V [B,Hkv,Nk,d], Hq a multiple of Hkv (query head h reads KV head
//    h / (Hq/Hkv)); out [B,Hq,Nq,d]; optional lse [B,Hq,Nq] fp32 (natural log of the sum of
//    exp(scaled scores)).
//  - Query row r sits at position p = r + Nk - Nq. Causal: it sees keys n <= p. A sliding window
//    (left, right) keeps keys with p - left <= n <= p + right (a negative side is unbounded). A row
//    that sees no key outputs zeros and lse = -inf. The window does not change the policy's tiles.
//  - Tile (qtile = floor(p/128), ktile = n/128) uses policy.high when policy.is_high() says so,
//    else policy.low. Each row of Q and K is quantized once per format (32-blocks along d; NVFP4:
//    16-blocks with E4M3 scales, under one fp32 second scale per row, nvfp4_tensor_scale of the
//    row's amax: each token uses the E4M3 scales' whole range).
//  - Score S = sum over blocks c, in order, of (sq[c]*sk[c]) * dot_c, each dot in fp32; s = S*scale.
//  - Online softmax over key tiles in ascending order, per row: m' = max(m, max s), alpha =
//    exp(m - m'), p = exp(s - m'), l = l*alpha + sum p (fp32, unrounded p), acc = acc*alpha + P.V.
//  - P.V per tile, accumulated into acc in fp32: pv=bf16: bf16(p) * bf16(V); pv=mxfp8: p over the
//    tile's keys and each column of V quantized to MXFP8 E4M3 in 32-key blocks (policy.scale_rule;
//    keys past Nk are zeros), blockwise as for S. Caveat: a V block that straddles a causal
//    boundary shares one scale, so a masked key's V can change the rounding of visible keys' V.
//    pv=mxfp4: the same with V in MXFP4. pv=fp8: sum over the tile of E4M3(p * 2^8) * E4M3 codes
//    of V (each column under one E8M0 scale from its amax over all Nk keys, policy.scale_rule),
//    times the column's scale and 2^-8 (the same caveat, over the whole sequence).
//  - out = acc / l; lse = m + log(l).
//  - Accuracy transforms (policy; exact in real arithmetic, they change only what is quantized), in
//    this order: rotate (Q and K rows by the randomized Hadamard of dmattn/rotation.hpp; the scale is
//    divided by its block size), smooth_k (K minus its per-channel mean over Nk, per batch and KV
//    head; lse adds back scale * q.mean), smooth_q (Q minus its per-channel mean mu over the Nq rows of
//    the call, per batch and head, taken before the rotation and rotated with the rows; every score
//    gains mu.k' in fp32, k' the key as quantized below but unquantized; smooth_q=high: only the
//    high tiles' queries are centred and their scores corrected). With any transform on, the
//    transformed Q and K rows are rounded to bf16 and quantized from there. sink_keys: the keys at positions < sink_keys score
//    dot(q_rot, k') in fp32 (q_rot: q rotated, unrounded) instead of the quantized sum (+ mu.k').
//    Means and these dots accumulate in fp64 and round once to fp32.
// `exact` ignores the policy and computes softmax(QK^T * scale) V in fp64 (the quality oracle).
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "dmattn/policy.hpp"
#include "dmattn/tensor.hpp"

namespace dmattn {

enum class Backend : uint8_t { automatic, cpu, cuda };
std::string_view backend_name(Backend b);
Backend parse_backend(std::string_view name);

struct AttentionOptions {
  bool causal = false;
  std::optional<float> softmax_scale;  // default 1/sqrt(d)
  Policy policy{};
  Backend backend = Backend::automatic;
  bool exact = false;  // fp64 reference instead of DMA
  int threads = 0;     // CPU worker threads; 0 = all hardware threads
  // CUDA backend: the cudaStream_t every launch and allocation is ordered on (null: the default
  // stream). The result is stream-ordered (as a PyTorch op's): read it on `stream`, after a sync of
  // it, or through the default stream's blocking copies when `stream` is null. With check_finite the
  // call waits until the inputs' NaN/Inf flags are known (after its quantize pass, not its attention
  // kernel) and throws on one (the output is then unspecified); the kernel may still be running when it returns.
  void* stream = nullptr;
  // false skips the check: a NaN/Inf input then shows as NaN in the output rows it reaches instead
  // of an exception (CUDA: the call returns once its work is enqueued on `stream`; CPU: no input scan).
  bool check_finite = true;
  // Absolute positions of the first query and the first key (default: bottom-right alignment, the
  // queries are the last Nq of Nk positions: q_offset = Nk - Nq, k_offset = 0). Set both to attend a
  // block of a longer sequence, e.g. one shard pair of ring attention: the causal mask and the
  // policy's tiles then use these positions. k_offset must be a multiple of 128 (whole key tiles).
  std::optional<int64_t> q_offset, k_offset;
  // Sliding window (flash-attn's window_size): a query at position p sees keys in [p - left,
  // p + right]; -1 leaves that side unbounded. Key tiles wholly outside it are skipped.
  int64_t window_left = -1, window_right = -1;
};

// Throws dmattn::Error on invalid input (shapes, head dim, NaN/Inf, unavailable backend).
// The CUDA backend (tensors on the GPU; out and lse there too) enqueues its work on opts.stream and
// returns before the result is ready (stream-ordered: AttentionOptions::stream says when to read it).
// It keeps per-device state for the life of the process (a scratch memory pool, side streams and
// events per host thread, kernel attributes): a cudaDeviceReset() in between calls is not supported.
void attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
               float* lse, const AttentionOptions& opts);

// Packed variable-length batches (flash-attn's varlen): q and out hold total_q tokens of all the
// sequences one after another, [1, Hq, total_q, d] views (a packed [total_q, Hq, d] array is the view
// with strides {0, d, Hq d, 1}), k and v [1, Hkv, total_k, d]. Sequence i owns query rows
// [cu_seqlens_q[i], cu_seqlens_q[i+1]) and key rows [cu_seqlens_k[i], cu_seqlens_k[i+1]), and is
// attended alone, exactly as attention() attends it (bottom-right causal alignment, the window and
// the policy's tiles from its own first token). lse, if given, is [Hq, total_q] (flash-attn's layout).
// A sequence with queries but no keys is an error; one with no queries is skipped. On CUDA tensors
// the whole batch is one call (one pre-pass and one prefill kernel, each sequence's keys in tiles of
// their own, the query tiles of all sequences scheduled longest first) for bf16 or fp16 tensors under
// the default's formats (MXFP8-E4M3 and MXFP4 tiles), pv=bf16 and the transforms rotate and smooth_k
// (each sequence's own key mean); otherwise, and on the CPU, each sequence is one attention() call on
// opts.stream. Both give the same bits.
void varlen_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      float* lse, const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k,
                      const AttentionOptions& opts);

// Copies contiguous host tensors to the current CUDA device, runs attention() there (the CUDA
// backend), and copies out and lse back. Returns the device time of the attention call alone, in
// ms (CUDA events; the copies are outside it). Throws dmattn::Error in a build without CUDA.
double attention_on_device(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                           float* lse, const AttentionOptions& opts);

// Whether the CUDA backend can run here: the build has it and a CUDA device is present.
bool cuda_device_available();

// Head dims the library accepts: multiples of 32 from 32 to 256.
bool head_dim_supported(int64_t d);

}  // namespace dmattn
