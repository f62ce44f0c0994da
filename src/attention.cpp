// The one dispatch point: validates a call and hands it to a backend.
#include "dmattn/attention.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "cuda/prefill/packing.hpp"
#include "problem.hpp"
#include "dmattn/error.hpp"

namespace dmattn {

bool head_dim_supported(int64_t d) { return d >= 32 && d <= 256 && d % 32 == 0; }

namespace {

void check_finite(const TensorView& t, const char* name) {
  std::vector<float> row(size_t(t.shape[3]));
  for (int64_t b = 0; b < t.shape[0]; ++b)
    for (int64_t h = 0; h < t.shape[1]; ++h)
      for (int64_t n = 0; n < t.shape[2]; ++n) {
        load_row(t, b, h, n, row.data());
        for (int64_t i = 0; i < t.shape[3]; ++i)
          if (!std::isfinite(row[size_t(i)]))
            throw Error(std::string(name) + " holds a non-finite value (" + std::to_string(row[size_t(i)]) + ") at [" +
                        std::to_string(b) + "," + std::to_string(h) + "," + std::to_string(n) + "," +
                        std::to_string(i) + "]");
      }
}

void check_view(const TensorView& t, const char* name) {
  if (!t.data) throw Error(std::string(name) + " has no data");
  for (int i = 0; i < 4; ++i)
    if (t.shape[i] < 1) throw Error(std::string(name) + " has an empty dimension: shape " + shape_str(t.shape));
}

}  // namespace

Problem validate(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                 float* lse, const AttentionOptions& o) {
  check_view(q, "Q");
  check_view(k, "K");
  check_view(v, "V");
  check_view(out, "out");
  if (k.shape != v.shape)
    throw Error("K and V shapes differ: " + shape_str(k.shape) + " vs " + shape_str(v.shape));
  if (q.shape[0] != k.shape[0])
    throw Error("batch sizes differ: Q " + shape_str(q.shape) + ", K " + shape_str(k.shape));
  if (q.shape[3] != k.shape[3])
    throw Error("head dims differ: Q d=" + std::to_string(q.shape[3]) + ", K d=" + std::to_string(k.shape[3]));
  if (!head_dim_supported(q.shape[3]))
    throw Error("head dim " + std::to_string(q.shape[3]) + " is not supported (multiples of 32 from 32 to 256)");
  if (q.shape[1] % k.shape[1] != 0)
    throw Error("query heads (" + std::to_string(q.shape[1]) + ") are not a multiple of KV heads (" +
                std::to_string(k.shape[1]) + ")");
  if (out.shape != q.shape) throw Error("out shape " + shape_str(out.shape) + " differs from Q " + shape_str(q.shape));
  const Policy& pol = o.policy;
  pol.validate();
  const float scale = o.softmax_scale.value_or(1.0f / std::sqrt(float(q.shape[3])));
  if (!std::isfinite(scale) || scale <= 0.0f) throw Error("softmax scale must be finite and > 0");

  Problem p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  p.B = q.shape[0];
  p.Hq = q.shape[1];
  p.Hkv = k.shape[1];
  p.Nq = q.shape[2];
  p.Nk = k.shape[2];
  p.d = q.shape[3];
  p.scale = scale;
  p.causal = o.causal;
  p.policy = pol;
  p.threads = o.threads;
  p.stream = o.stream;
  p.check_finite = o.check_finite;
  p.q_pos0 = o.q_offset.value_or(p.Nk - p.Nq);
  p.k_pos0 = o.k_offset.value_or(0);
  p.window_left = o.window_left < 0 ? -1 : o.window_left;
  p.window_right = o.window_right < 0 ? -1 : o.window_right;
  if (p.k_pos0 % kTile != 0)
    throw Error("k_offset must be a multiple of 128 (whole key tiles), got " + std::to_string(p.k_pos0));
  return p;
}

namespace {
// Whether the CUDA backend runs a call on these tensors (else the CPU backend); throws where neither can.
bool runs_on_cuda(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                  const AttentionOptions& opts) {
  if (k.device != q.device || v.device != q.device || out.device != q.device)
    throw Error("Q, K, V and out must live on the same device");
  const bool on_gpu = q.device == Device::cuda;
  Backend backend = opts.backend;
  if (backend == Backend::automatic) backend = on_gpu ? Backend::cuda : Backend::cpu;
  if (backend == Backend::cpu && on_gpu) throw Error("the CPU backend needs host tensors (these are on the GPU)");
  if (backend == Backend::cpu) return false;
#if defined(DMATTN_HAVE_CUDA)
  if (!on_gpu) throw Error("the CUDA backend needs tensors on the GPU (attention_on_device stages host tensors)");
  if (opts.exact) throw Error("the exact fp64 reference runs on the CPU only");
  return true;
#else
  throw Error("this build has no CUDA backend (configure with -DDMATTN_CUDA=ON on a machine with nvcc)");
#endif
}
}  // namespace

void attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out, float* lse,
               const AttentionOptions& opts) {
  const Problem p = validate(q, k, v, out, lse, opts);
  if (runs_on_cuda(q, k, v, out, opts)) {
#if defined(DMATTN_HAVE_CUDA)
    cuda::dma_attention(p);
#endif
    return;
  }
  if (opts.check_finite) {
    check_finite(q, "Q");
    check_finite(k, "K");
    check_finite(v, "V");
  }
  if (opts.exact)
    cpu::exact_attention(p);
  else
    cpu::dma_attention(p);
}

void varlen_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      float* lse, const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                      const AttentionOptions& opts) {
  const char* what = "varlen attention";
  if (q.shape[0] != 1 || k.shape[0] != 1 || v.shape[0] != 1 || out.shape[0] != 1)
    throw Error(std::string(what) + ": q, k, v and out hold packed tokens: [1, H, total, d] views");
  if (opts.q_offset || opts.k_offset) throw Error(std::string(what) + ": q_offset and k_offset are per call, not per sequence");
  if (cu_q.size() != cu_k.size() || cu_q.size() < 2)
    throw Error(std::string(what) + ": cu_seqlens_q and cu_seqlens_k need the same length, batch + 1 >= 2");
  for (const auto* cu : {&cu_q, &cu_k}) {
    const bool is_q = cu == &cu_q;
    const int64_t total = is_q ? q.shape[2] : k.shape[2];
    if ((*cu)[0] != 0 || (*cu).back() != total)
      throw Error(std::string(what) + ": cu_seqlens_" + (is_q ? "q" : "k") + " must run from 0 to " +
                  std::to_string(total) + " (the packed tokens), got " + std::to_string((*cu)[0]) + " .. " +
                  std::to_string((*cu).back()));
    for (size_t i = 1; i < cu->size(); ++i)
      if ((*cu)[i] < (*cu)[i - 1])
        throw Error(std::string(what) + ": cu_seqlens_" + (is_q ? "q" : "k") + " decreases at " + std::to_string(i));
  }
  for (size_t i = 0; i + 1 < cu_q.size(); ++i)
    if (cu_q[i + 1] > cu_q[i] && cu_k[i + 1] == cu_k[i])
      throw Error(std::string(what) + ": sequence " + std::to_string(i) + " has queries but no keys");
#if defined(DMATTN_HAVE_CUDA)
  // The CUDA prefill takes the whole packed batch in one call where the policy allows.
  if (runs_on_cuda(q, k, v, out, opts)) {
    const Problem p = validate(q, k, v, out, lse, opts);
    if (cuda::packs(p)) {
      const cuda::Packing packing(cu_q, cu_k, p.mask());
      cuda::dma_attention(p, &packing);
      return;
    }
  }
#endif
  const int64_t Hq = q.shape[1], total_q = q.shape[2];
  for (size_t i = 0; i + 1 < cu_q.size(); ++i) {
    const int64_t q0 = cu_q[i], nq = cu_q[i + 1] - q0, k0 = cu_k[i], nk = cu_k[i + 1] - k0;
    if (nq == 0) continue;
    const TensorView qi = slice_tokens(q, q0, nq), ki = slice_tokens(k, k0, nk), vi = slice_tokens(v, k0, nk),
                     oi = slice_tokens(out, q0, nq);
    if (!lse) {
      attention(qi, ki, vi, oi, nullptr, opts);
    } else if (runs_on_cuda(qi, ki, vi, oi, opts)) {
#if defined(DMATTN_HAVE_CUDA)
      cuda::dma_attention_lse_rows(validate(qi, ki, vi, oi, nullptr, opts), lse + q0, total_q);
#endif
    } else {  // the sequence's [Hq, nq] rows into their columns of [Hq, total_q]
      std::vector<float> rows(size_t(Hq * nq));
      attention(qi, ki, vi, oi, rows.data(), opts);
      for (int64_t h = 0; h < Hq; ++h) std::copy_n(rows.data() + h * nq, nq, lse + h * total_q + q0);
    }
  }
}

#if !defined(DMATTN_HAVE_CUDA)
bool cuda_device_available() { return false; }

double attention_on_device(const TensorView&, const TensorView&, const TensorView&, const TensorView&, float*,
                           const AttentionOptions&) {
  throw Error("this build has no CUDA backend (configure with -DDMATTN_CUDA=ON on a machine with nvcc)");
}
#endif

}  // namespace dmattn
