// The `dmattn._dmattn` extension: thin nanobind bindings over the C++ API. Arrays arrive through
// DLPack / the buffer protocol (numpy, PyTorch CPU and CUDA) as views, never copied here; the
// Python layer (python/dmattn/__init__.py) allocates outputs and handles argument conventions.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <variant>

#include "dmattn/attention.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/paged_kv_cache.hpp"
#include "dmattn/quantize.hpp"

namespace nb = nanobind;
using namespace dmattn;

namespace {

template <class Array>
DType dtype_of(const Array& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1 && t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32) return DType::f32;
  if (t.lanes == 1 && t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return DType::f16;
  if (t.lanes == 1 && t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return DType::bf16;
  throw Error(std::string(name) + ": unsupported dtype (float32, float16 and bfloat16 are supported)");
}

// Inputs are only read, so read-only arrays (memory maps, broadcast views) are accepted.
using In = nb::ndarray<nb::ro>;

// A 4-D array as a [B, H, N, d] view; layout "bnhd" swaps the middle axes (no copy).
template <class Array>
TensorView view_of(const Array& a, const char* name, const std::string& layout) {
  if (a.ndim() != 4) throw Error(std::string(name) + ": expected 4 dimensions, got " + std::to_string(a.ndim()));
  Device dev;
  if (a.device_type() == nb::device::cpu::value)
    dev = Device::cpu;
  else if (a.device_type() == nb::device::cuda::value)
    dev = Device::cuda;
  else
    throw Error(std::string(name) + ": unsupported device (CPU and CUDA arrays are supported)");
  TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));  // written only when it is an output
  v.dtype = dtype_of(a, name);
  v.device = dev;
  for (int i = 0; i < 4; ++i) {
    v.shape[i] = int64_t(a.shape(i));
    v.stride[i] = int64_t(a.stride(i));
  }
  if (layout == "bnhd") {
    std::swap(v.shape[1], v.shape[2]);
    std::swap(v.stride[1], v.stride[2]);
  } else if (layout != "bhnd") {
    throw Error("layout must be 'bhnd' or 'bnhd' (got '" + layout + "')");
  }
  return v;
}

// The LSE output for q's rows: a contiguous float32 [B, Hq, Nq] array on q's device, or null.
float* lse_of(const std::optional<nb::ndarray<>>& lse, const TensorView& q) {
  if (!lse) return nullptr;
  const nb::ndarray<>& l = *lse;
  if (dtype_of(l, "lse") != DType::f32 || l.ndim() != 3 || int64_t(l.shape(0)) != q.shape[0] ||
      int64_t(l.shape(1)) != q.shape[1] || int64_t(l.shape(2)) != q.shape[2] ||
      (l.shape(2) > 1 && l.stride(2) != 1) || (l.shape(1) > 1 && l.stride(1) != int64_t(l.shape(2))) ||
      (l.shape(0) > 1 && l.stride(0) != int64_t(l.shape(1) * l.shape(2))))  // an axis of extent 1 has any stride
    throw Error("lse: expected a contiguous float32 array of shape [B, Hq, Nq] (q's first three axes)");
  if ((l.device_type() == nb::device::cuda::value) != (q.device == Device::cuda))
    throw Error("lse: must live on the same device as q");
  return static_cast<float*>(l.data());
}

void attention_into(const In& q, const In& k, const In& v, const nb::ndarray<>& out,
                    std::optional<nb::ndarray<>> lse, const std::string& layout, const AttentionOptions& o) {
  const TensorView tq = view_of(q, "q", layout), tk = view_of(k, "k", layout), tv = view_of(v, "v", layout),
                   to = view_of(out, "out", layout);
  float* lse_ptr = lse_of(lse, tq);
  nb::gil_scoped_release unlocked;  // compute without holding the GIL
  attention(tq, tk, tv, to, lse_ptr, o);
}

// Packed sequences: q, k, v, out [1, total, H, d] ("bnhd"), lse [1, Hq, total_q].
void varlen_attention_into(const In& q, const In& k, const In& v, const nb::ndarray<>& out,
                           std::optional<nb::ndarray<>> lse, const std::vector<int32_t>& cu_seqlens_q,
                           const std::vector<int32_t>& cu_seqlens_k, const AttentionOptions& o) {
  const TensorView tq = view_of(q, "q", "bnhd"), tk = view_of(k, "k", "bnhd"), tv = view_of(v, "v", "bnhd"),
                   to = view_of(out, "out", "bnhd");
  float* lse_ptr = lse_of(lse, tq);
  nb::gil_scoped_release unlocked;
  varlen_attention(tq, tk, tv, to, lse_ptr, cu_seqlens_q, cu_seqlens_k, o);
}

using F32Array = nb::ndarray<nb::numpy, const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8Out = nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>;

template <class T>
nb::ndarray<nb::numpy, T, nb::ndim<2>> to_numpy(std::vector<T> data, int64_t rows, int64_t cols) {
  auto* heap = new std::vector<T>(std::move(data));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<2>>(heap->data(), {size_t(rows), size_t(cols)}, owner);
}

nb::tuple quantize_rows(const F32Array& x, const std::string& format, const std::string& rule) {
  const Format f = parse_format(format);
  const ScaleRule r = parse_scale_rule(rule);
  if (!format_info(f).has_codes) throw Error("format " + format + " has no MX codes (bf16 is not a quantized format)");
  const int64_t rows = int64_t(x.shape(0)), cols = int64_t(x.shape(1));
  Quantized q;
  {
    nb::gil_scoped_release unlocked;
    q = quantize(x.data(), rows, cols, f, r);
  }
  const int64_t cc = q.code_cols(), sc = q.scale_cols();
  return nb::make_tuple(to_numpy(std::move(q.codes), rows, cc), to_numpy(std::move(q.scales), rows, sc), q.tensor_scale);
}

nb::ndarray<nb::numpy, float, nb::ndim<2>> dequantize_rows(
    const nb::ndarray<nb::numpy, const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>& codes,
    const nb::ndarray<nb::numpy, const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>& scales,
    const std::string& format, int64_t cols, float tensor_scale) {
  Quantized q;
  q.format = parse_format(format);
  q.rows = int64_t(codes.shape(0));
  q.cols = cols;
  q.tensor_scale = tensor_scale;
  if (int64_t(scales.shape(0)) != q.rows) throw Error("codes and scales must have the same number of rows");
  q.codes.assign(codes.data(), codes.data() + codes.size());
  q.scales.assign(scales.data(), scales.data() + scales.size());
  std::vector<float> values = dequantize(q);  // checks the shapes against the format
  return to_numpy(std::move(values), q.rows, cols);
}

// A CPU view for the cache's appends (the cache lives in host memory).
TensorView cpu_view(const In& a, const char* name) {
  const TensorView v = view_of(a, name, "bhnd");
  if (v.device != Device::cpu) throw Error(std::string(name) + ": the KV cache takes CPU arrays (it lives in host memory)");
  return v;
}

template <class Cache>
void decode_into(const Cache& cache, const std::vector<int>& seqs, const In& q, const nb::ndarray<>& out,
                 std::optional<nb::ndarray<>> lse, const DecodeOptions& o) {
  const TensorView tq = view_of(q, "q", "bhnd"), to = view_of(out, "out", "bhnd");
  float* lse_ptr = lse_of(lse, tq);
  nb::gil_scoped_release unlocked;
  decode_attention(cache, seqs, tq, to, lse_ptr, o);
}

// smooth_q in Python: False (off), True (every tile) or "high" (the high tiles alone); the names
// "off" and "all" are taken too.
using SmoothQArg = std::variant<bool, std::string>;
SmoothQ smooth_q_of(const SmoothQArg& v) {
  if (const bool* on = std::get_if<bool>(&v)) return *on ? SmoothQ::all : SmoothQ::off;
  return parse_smooth_q(std::get<std::string>(v));
}
nb::object smooth_q_value(SmoothQ s) {
  if (s == SmoothQ::high) return nb::str("high");
  return nb::bool_(s == SmoothQ::all);
}

std::string policy_repr(const Policy& p) {
  return "Policy(high='" + std::string(format_name(p.high)) + "', low='" + std::string(format_name(p.low)) +
         "', diag_tiles=" + std::to_string(p.diag_tiles) + ", sink_tiles=" + std::to_string(p.sink_tiles) +
         ", scale_rule='" + std::string(scale_rule_name(p.scale_rule)) + "', pv='" + std::string(pv_name(p.pv)) +
         "', smooth_k=" + (p.smooth_k ? "True" : "False") + ", smooth_q=" +
         (p.smooth_q == SmoothQ::high ? "'high'" : p.smooth_q == SmoothQ::all ? "True" : "False") +
         ", rotate=" + (p.rotate ? "True" : "False") + ", sink_keys=" + std::to_string(p.sink_keys) +
         ", q_residual=" + (p.q_residual ? "True" : "False") + ")";
}

// Policy's format fields read and written as their names ("mxfp4", ...).
auto format_getter(Format Policy::*field) {
  return [field](const Policy& p) { return std::string(format_name(p.*field)); };
}
auto format_setter(Format Policy::*field) {
  return [field](Policy& p, const std::string& name) { p.*field = parse_format(name); };
}

// What both caches share: construction from (kv_heads, head_dim, policy), sequences, lengths, page
// tables and their shape.
template <class Cache>
nb::class_<Cache>& bind_cache(nb::class_<Cache>& c) {
  return c.def(nb::init<int64_t, int64_t, const Policy&>(), nb::arg("kv_heads"), nb::arg("head_dim"),
               nb::arg("policy") = Policy{})
      .def("new_sequence", &Cache::new_sequence, "An empty sequence; returns its id.")
      .def("free_sequence", &Cache::free_sequence, nb::arg("seq"), "Returns the sequence's pages to the pool.")
      .def("length", &Cache::length, nb::arg("seq"))
      .def("page_table", &Cache::page_table, nb::arg("seq"), "Logical page -> physical page.")
      .def_prop_ro("kv_heads", &Cache::kv_heads)
      .def_prop_ro("head_dim", &Cache::head_dim)
      .def_prop_ro("policy", &Cache::policy);
}

}  // namespace

NB_MODULE(_dmattn, m) {
  m.doc() = "dmattn's compiled core (use the `dmattn` package, not this module directly).";
  nb::exception<Error>(m, "DmattnError", PyExc_ValueError);

  nb::class_<Policy>(m, "Policy", "Which 128x128 tiles run in the high and the low format (docs/DESIGN.md).")
      .def(
          "__init__",
          [](Policy* self, const std::string& high, const std::string& low, int diag_tiles, int sink_tiles,
             const std::string& scale_rule, const std::string& pv, bool smooth_k, const SmoothQArg& smooth_q, bool rotate,
             int sink_keys, bool q_residual) {
            Policy p;
            p.high = parse_format(high);
            p.low = parse_format(low);
            p.diag_tiles = diag_tiles;
            p.sink_tiles = sink_tiles;
            p.scale_rule = parse_scale_rule(scale_rule);
            p.pv = parse_pv(pv);
            p.smooth_k = smooth_k;
            p.smooth_q = smooth_q_of(smooth_q);
            p.rotate = rotate;
            p.sink_keys = sink_keys;
            p.q_residual = q_residual;
            p.validate();
            new (self) Policy(p);
          },
          nb::kw_only(), nb::arg("high") = std::string(format_name(Policy{}.high)),
          nb::arg("low") = std::string(format_name(Policy{}.low)), nb::arg("diag_tiles") = Policy{}.diag_tiles,
          nb::arg("sink_tiles") = Policy{}.sink_tiles, nb::arg("scale_rule") = std::string(scale_rule_name(Policy{}.scale_rule)),
          nb::arg("pv") = std::string(pv_name(Policy{}.pv)), nb::arg("smooth_k") = Policy{}.smooth_k,
          nb::arg("smooth_q") = smooth_q_value(Policy{}.smooth_q), nb::arg("rotate") = Policy{}.rotate,
          nb::arg("sink_keys") = Policy{}.sink_keys, nb::arg("q_residual") = Policy{}.q_residual)
      .def_prop_rw("high", format_getter(&Policy::high), format_setter(&Policy::high),
                   "format of the diagonal and sink tiles")
      .def_prop_rw("low", format_getter(&Policy::low), format_setter(&Policy::low), "format of every other tile")
      .def_rw("diag_tiles", &Policy::diag_tiles, "key tiles nearest the diagonal that run in the high format")
      .def_rw("sink_tiles", &Policy::sink_tiles, "leading key tiles that run in the high format")
      .def_prop_rw(
          "scale_rule", [](const Policy& p) { return std::string(scale_rule_name(p.scale_rule)); },
          [](Policy& p, const std::string& r) { p.scale_rule = parse_scale_rule(r); }, "E8M0 scale rule: ocp or ceil")
      .def_prop_rw(
          "pv", [](const Policy& p) { return std::string(pv_name(p.pv)); },
          [](Policy& p, const std::string& v) { p.pv = parse_pv(v); }, "P.V precision: bf16, mxfp8, mxfp4 (V in MXFP4) or fp8 (E4M3 P at 2^-8, per-channel V scales; prefill only)")
      .def_rw("smooth_k", &Policy::smooth_k, "subtract K's per-channel mean before quantizing")
      .def_prop_rw(
          "smooth_q", [](const Policy& p) { return smooth_q_value(p.smooth_q); },
          [](Policy& p, const SmoothQArg& v) { p.smooth_q = smooth_q_of(v); },
          "subtract each head's query mean, its scores added back exactly: False, True (every tile) or "
          "'high' (the high tiles alone)")
      .def_rw("rotate", &Policy::rotate, "rotate Q and K by a randomized Hadamard transform along d before quantizing")
      .def_rw("sink_keys", &Policy::sink_keys, "leading keys whose scores come from unquantized q and k")
      .def_rw("q_residual", &Policy::q_residual,
              "the high tiles take each query row plus its residual in E4M3 at the row's scale (two FP8 terms)")
      .def("__repr__", &policy_repr)
      .def("__eq__", [](const Policy& a, const Policy& b) { return policy_repr(a) == policy_repr(b); })
      .def_static("plain", &Policy::plain,
                  "MXFP8 on the diagonal tile, MXFP4 elsewhere, no transforms: the fastest policy (about +15% "
                  "perplexity against the default's +1%, docs/QUALITY.md)");

  nb::class_<KVCache> host(m, "KVCache",
                           "Paged MX-quantized KV cache (CPU): 128-token pages, K in the page's format (high for "
                           "the newest diag_tiles pages and the sink pages, low otherwise), V in bf16.");
  bind_cache(host)
      .def(
          "append",
          [](KVCache& c, int seq, const In& k, const In& v) {
            const TensorView tk = cpu_view(k, "k"), tv = cpu_view(v, "v");
            nb::gil_scoped_release unlocked;
            c.append(seq, tk, tv);
          },
          nb::arg("seq"), nb::arg("k"), nb::arg("v"), "Appends k, v: [1, kv_heads, n, head_dim] arrays.")
      .def("bytes", &KVCache::bytes, nb::arg("seq"), "Bytes the sequence holds (codes, scales, V, kept originals).");
  nb::class_<PagedKVCache> device(m, "PagedKVCache",
                                  "Paged MX-quantized KV cache in GPU memory: appends quantize on the GPU, decode "
                                  "reads device page tables; the pages equal KVCache's for the same appends.");
  bind_cache(device)
      .def(
          "append",
          [](PagedKVCache& c, const std::vector<int>& seqs, const In& k, const In& v, uintptr_t stream) {
            const TensorView tk = view_of(k, "k", "bhnd"), tv = view_of(v, "v", "bhnd");
            nb::gil_scoped_release unlocked;
            c.append(seqs, tk, tv, reinterpret_cast<void*>(stream));
          },
          nb::arg("seqs"), nb::arg("k"), nb::arg("v"), nb::arg("stream") = 0,
          "Appends k, v: [len(seqs), kv_heads, n, head_dim] CUDA tensors, enqueued on `stream`.")
      .def("reserve", &PagedKVCache::reserve, nb::arg("sequences"), nb::arg("tokens"),
           "Room for `sequences` sequences of `tokens` tokens (a CUDA graph's cache never moves).")
      .def(
          "prepare",
          [](PagedKVCache& c, const std::vector<int>& seqs, int64_t n, uintptr_t stream) {
            c.prepare(seqs, n, reinterpret_cast<void*>(stream));
          },
          nb::arg("seqs"), nb::arg("n"), nb::arg("stream") = 0,
          "The plan of the next append of n tokens to seqs, for a CUDA graph's replay.")
      .def_prop_ro("page_bytes", &PagedKVCache::page_bytes, "Device bytes of one 128-token page (all KV heads).");
  // The options structs, bound once: Python sets their fields by name (dmattn/__init__.py).
  nb::class_<AttentionOptions>(m, "AttentionOptions", "attention()'s options (include/dmattn/attention.hpp).")
      .def(nb::init<>())
      .def_rw("causal", &AttentionOptions::causal)
      .def_rw("softmax_scale", &AttentionOptions::softmax_scale, nb::arg().none())
      .def_rw("policy", &AttentionOptions::policy)
      .def_rw("check_finite", &AttentionOptions::check_finite)
      .def_rw("q_offset", &AttentionOptions::q_offset, nb::arg().none())
      .def_rw("k_offset", &AttentionOptions::k_offset, nb::arg().none())
      .def_rw("window_left", &AttentionOptions::window_left)
      .def_rw("window_right", &AttentionOptions::window_right)
      .def_prop_rw("stream", [](const AttentionOptions& o) { return reinterpret_cast<uintptr_t>(o.stream); },
                   [](AttentionOptions& o, uintptr_t s) { o.stream = reinterpret_cast<void*>(s); });
  nb::class_<DecodeOptions>(m, "DecodeOptions", "decode()'s options (include/dmattn/kv_cache.hpp).")
      .def(nb::init<>())
      .def_rw("softmax_scale", &DecodeOptions::softmax_scale, nb::arg().none())
      .def_rw("splits", &DecodeOptions::splits)
      .def_rw("window_left", &DecodeOptions::window_left)
      .def_prop_rw("stream", [](const DecodeOptions& o) { return reinterpret_cast<uintptr_t>(o.stream); },
                   [](DecodeOptions& o, uintptr_t s) { o.stream = reinterpret_cast<void*>(s); });
  m.def("decode_into", &decode_into<PagedKVCache>, nb::arg("cache"), nb::arg("seqs"), nb::arg("q"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("options"));
  m.def("decode_into", &decode_into<KVCache>, nb::arg("cache"), nb::arg("seqs"), nb::arg("q"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("options"), "Decode attention over the cache.");
  m.def("attention_into", &attention_into, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("layout"), nb::arg("options"),
        "DMA attention of q, k, v into out (and lse), all of one device.");
  m.def("varlen_attention_into", &varlen_attention_into, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("options"),
        "Packed variable-length attention into out (and lse [1, Hq, total_q]), all of one device.");
  m.def("quantize_rows", &quantize_rows, nb::arg("x"), nb::arg("format"), nb::arg("scale_rule"),
        "float32 [rows, cols] -> (codes, scales, tensor_scale), the CPU codec.");
  m.def("dequantize_rows", &dequantize_rows, nb::arg("codes"), nb::arg("scales"), nb::arg("format"), nb::arg("cols"),
        nb::arg("tensor_scale"), "Inverse of quantize_rows: float32 [rows, cols].");
  m.def("cuda_available", &cuda_device_available,
        "Whether CUDA tensors can be computed: the build has the CUDA backend and a CUDA device is present.");
}
