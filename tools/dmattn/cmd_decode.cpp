// `dmattn decode`: K/V into a paged MX KV cache (one sequence per batch entry), then decode
// attention for q's rows as the newest tokens — what `run --causal` computes for the same files,
// through the cache (equal bit for bit on the CPU with one split).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "dmattn/kv_cache.hpp"
#include "dmattn/npy.hpp"

namespace dmattn::cli {

void add_decode(CLI::App& app) {
  struct Args {
    QkvFiles files;
    std::optional<float> softmax_scale;
    PolicyArgs policy;
    int splits = 0, repeat = 1;
    std::pair<int64_t, int64_t> window{-1, -1};
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "decode", "decode attention over a paged MX KV cache filled from K/V .npy (q's rows are the newest tokens)");
  args->files.add_to(*cmd, "new queries [B,Hq,Nq,d], 1 <= Nq <= 16", "keys [B,Hkv,L,d] (the last Nq are the new tokens')",
                     "values [B,Hkv,L,d]");
  cmd->add_option("--softmax-scale", args->softmax_scale, "scale of QK^T (default 1/sqrt(d))");
  cmd->add_option("--splits", args->splits, "split-KV count (0 = automatic: 1 on the CPU, enough to fill the GPU)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  add_repeat(*cmd, args->repeat);
  add_window(*cmd, args->window, "; decode is causal: RIGHT has no effect");
  args->policy.add_to(*cmd);
  cmd->callback([args] {
    check_outputs({{"--out", args->files.out}, {"--lse", args->files.lse}});
    const AttentionOptions ao = args->policy.options();
    const HostTensor q = read_npy_tensor(args->files.q, "--q");
    HostTensor k = read_npy_tensor(args->files.k, "--k"), v = read_npy_tensor(args->files.v, "--v");  // viewed per sequence
    const Shape &qs = q.shape(), &ks = k.shape();
    if (k.shape() != v.shape()) throw Error("--k and --v must have the same shape");
    if (ks[0] != qs[0] || ks[3] != qs[3])
      throw Error("--q " + shape_str(qs) + " and --k " + shape_str(ks) + " differ in batch or head dim");
    KVCache cache(ks[1], ks[3], ao.policy);
    std::vector<int> seqs;
    const size_t kbytes = size_t(ks[1] * ks[2] * ks[3]) * dtype_size(k.dtype());
    for (int64_t b = 0; b < ks[0]; ++b) {
      const Shape one{1, ks[1], ks[2], ks[3]};
      seqs.push_back(cache.new_sequence());
      cache.append(seqs.back(), TensorView::contiguous(k.bytes() + b * kbytes, k.dtype(), one),
                   TensorView::contiguous(v.bytes() + b * kbytes, v.dtype(), one));
    }
    DecodeOptions o;
    o.softmax_scale = args->softmax_scale;
    o.splits = args->splits;
    o.window_left = args->window.first;
    o.threads = ao.threads;
    HostTensor out(DType::f32, qs);
    std::vector<float> lse(size_t(qs[0] * qs[1] * qs[2]));
    std::vector<double> times;
    for (int i = 0; i < args->repeat; ++i) {
      if (ao.backend == Backend::cuda) {  // the device's time; the first call uploads the cache's pages
        times.push_back(decode_on_device(cache, seqs, q.view(), out.view(), lse.data(), o) / 1e3);
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        decode_attention(cache, seqs, q.view(), out.view(), lse.data(), o);
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    std::sort(times.begin(), times.end());
    write_npy(args->files.out, NpyType::f32, {qs[0], qs[1], qs[2], qs[3]}, out.bytes());
    if (!args->files.lse.empty()) write_npy(args->files.lse, NpyType::f32, {qs[0], qs[1], qs[2]}, lse.data());
    const double bf16_bytes = 2.0 * 2.0 * double(ks[1] * ks[2] * ks[3]);  // K and V in bf16
    std::fprintf(stderr,
                 "dmattn decode: q %s over %lld cached tokens x %lld sequences, %s, on %s in %.6f s (median of %d); "
                 "cache %.2f MB a sequence (%.2fx of bf16 K+V) -> %s\n",
                 shape_str(qs).c_str(), static_cast<long long>(ks[2]), static_cast<long long>(ks[0]),
                 ao.policy.describe().c_str(), ao.backend == Backend::cuda ? "cuda" : "cpu", times[times.size() / 2],
                 args->repeat, double(cache.bytes(seqs[0])) / 1e6, double(cache.bytes(seqs[0])) / bf16_bytes,
                 args->files.out.c_str());
  });
}

}  // namespace dmattn::cli
