#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "dmattn/npy.hpp"

namespace dmattn::cli {

void add_run(CLI::App& app) {
  struct Args {
    QkvFiles files;
    bool causal = false, exact = false;
    std::optional<float> softmax_scale;
    PolicyArgs policy;
    int repeat = 1;
    std::pair<int64_t, int64_t> window{-1, -1};
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("run", "attention over Q/K/V .npy files ([B,H,N,d], float32 or float16)");
  args->files.add_to(*cmd, "queries [B,Hq,Nq,d]", "keys [B,Hkv,Nk,d]", "values [B,Hkv,Nk,d]");
  cmd->add_flag("--causal", args->causal, "causal mask, last query aligned with last key");
  cmd->add_option("--softmax-scale", args->softmax_scale, "scale of QK^T (default 1/sqrt(d))");
  cmd->add_flag("--exact", args->exact, "fp64 reference attention instead of DMA");
  add_repeat(*cmd, args->repeat);
  add_window(*cmd, args->window, "");
  args->policy.add_to(*cmd);
  cmd->callback([args] {
    if (args->exact && args->policy.policy_given())
      throw Error("--exact computes fp64 attention and takes no policy flags (--high, --low, --diag-tiles, ...)");
    check_outputs({{"--out", args->files.out}, {"--lse", args->files.lse}});
    AttentionOptions o = args->policy.options();
    o.causal = args->causal;
    o.exact = args->exact;
    o.softmax_scale = args->softmax_scale;
    o.window_left = args->window.first;
    o.window_right = args->window.second;
    const HostTensor q = read_npy_tensor(args->files.q, "--q");
    const HostTensor k = read_npy_tensor(args->files.k, "--k");
    const HostTensor v = read_npy_tensor(args->files.v, "--v");
    HostTensor out(DType::f32, q.shape());
    const Shape& s = q.shape();
    std::vector<float> lse(size_t(s[0] * s[1] * s[2]));
    std::vector<double> times;
    for (int i = 0; i < args->repeat; ++i) {
      if (o.backend == Backend::cuda) {  // stage to the GPU; the time is the device's, copies excluded
        times.push_back(attention_on_device(q.view(), k.view(), v.view(), out.view(), lse.data(), o) / 1e3);
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        attention(q.view(), k.view(), v.view(), out.view(), lse.data(), o);
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    std::sort(times.begin(), times.end());
    const double secs = times[times.size() / 2];
    write_npy(args->files.out, NpyType::f32, {s[0], s[1], s[2], s[3]}, out.bytes());
    if (!args->files.lse.empty()) write_npy(args->files.lse, NpyType::f32, {s[0], s[1], s[2]}, lse.data());
    std::fprintf(stderr, "dmattn run: %s %s%s on %s in %.6f s (median of %d) -> %s\n", shape_str(s).c_str(),
                 o.exact ? "exact fp64" : o.policy.describe().c_str(), o.causal ? " causal" : "",
                 o.backend == Backend::cuda ? "cuda" : "cpu", secs, args->repeat,
                 args->files.out.c_str());
  });
}

}  // namespace dmattn::cli
