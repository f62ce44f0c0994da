// In-process timing of dmattn's CUDA attention() on device-resident bf16 inputs (no files, so large
// N fits): B=1 (DMATTN_BENCH_BATCH=B: B sequences), causal, GQA; prints one line per (N, d, policy): "dmattn <policy> N d ms TFLOP/s".
// compare_sdpa.py runs it for the shapes whose .npy files would be too large for the CLI route.
// Usage: bench_prefill_cuda N d [iters [policies]]   (policies: names below, comma-separated, run in that
// order in one process; default all, in the table's order)
// DMATTN_BENCH_QUEUED=1: each timed call is enqueued behind a ~2 ms busy kernel, so the host has
// issued all of its work before the device reaches it: the figure is device time alone (the name
// gets "-queued"), without the host's launch gaps that the plain figure (like SDPA's) includes.
// Either way stderr gets the host's median time inside the call ("host-us").
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "dmattn/attention.hpp"
#include "dmattn/numeric.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;

// Keeps the device busy for about `cycles` clocks (the queued mode's head start for the host).
__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s N d [iters] [policy[,policy...]] [nocheck]\n", argv[0]);
    return 2;
  }
  const int64_t N = std::atoll(argv[1]), d = std::atoll(argv[2]), HQ = 32, HKV = 8;
  const char* batch_env = std::getenv("DMATTN_BENCH_BATCH");  // B sequences of N (default 1)
  const int64_t B = batch_env ? std::max<int64_t>(1, std::atoll(batch_env)) : 1;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 5;
  const std::string order = argc > 4 ? argv[4] : "";
  // "nocheck": check_finite = false (no read-back of the NaN/Inf flags, so no host sync in the call)
  const bool check = !(argc > 5 && std::string(argv[5]) == "nocheck");
  Rng rng(7);
  auto upload = [&](int64_t heads) {
    std::vector<uint16_t> h(static_cast<size_t>(B * heads * N * d));
    for (auto& x : h) x = to_bf16(float(rng.normal())).bits;
    void* p = nullptr;
    if (cudaMalloc(&p, h.size() * 2) != cudaSuccess || cudaMemcpy(p, h.data(), h.size() * 2, cudaMemcpyHostToDevice) != cudaSuccess) {
      std::fprintf(stderr, "allocation failed\n");
      std::exit(1);
    }
    return TensorView::contiguous(p, DType::bf16, {B, heads, N, d}, Device::cuda);
  };
  const TensorView q = upload(HQ), k = upload(HKV), v = upload(HKV), out = upload(HQ);
  const double flops = 2.0 * double(B) * HQ * double(N) * double(N) * double(d);  // the issue's convention
  struct Named {
    const char* name;
    Policy policy;
  };
  Policy pv_fp8 = Policy::plain();
  pv_fp8.pv = PV::fp8;
  // The accuracy transforms: rotate + smooth_k (the pre-pass alone), smooth_q (the kernel's per-key
  // addition; everywhere, or on the high tiles), all four, and all four with MXFP8 on 4 diagonal
  // tiles and the sink tile; the bands without transforms.
  auto tf = [](int diag, int sinks, bool sk, bool sq, bool rot, int sink_keys) {
    Policy p = Policy::tiles(Format::mxfp8_e4m3, Format::mxfp4, diag, sinks);
    p.smooth_k = sk;
    p.smooth_q = sq ? SmoothQ::all : SmoothQ::off;
    p.rotate = rot;
    p.sink_keys = sink_keys;
    return p;
  };
  const Policy no_high = tf(0, 0, true, false, true, 0);  // the default's transforms, every tile MXFP4
  Policy default_sq, default_sqh, no_high_sqh = no_high;
  default_sq.smooth_q = SmoothQ::all;
  default_sqh.smooth_q = no_high_sqh.smooth_q = SmoothQ::high;
  const Named policies[] = {{"DMA-default", Policy{}},
                            {"DMA-default-sq", default_sq},
                            {"DMA-default-sqh", default_sqh},
                            // no high tile: smooth_q=high's pre-pass and kernel instance with nothing to correct
                            {"DMA-rot-sk-d0s0", no_high},
                            {"DMA-rot-sk-d0s0-sqh", no_high_sqh},
                            {"DMA-plain", tf(1, 0, false, false, false, 0)},
                            {"DMA-rot-sk", tf(1, 0, true, false, true, 0)},
                            {"DMA-sq", tf(1, 0, false, true, false, 0)},
                            {"DMA-rot-sk-sink", tf(1, 0, true, false, true, 1)},
                            {"DMA-rot-sk-d1s1", tf(1, 1, true, false, true, 0)},
                            {"DMA-rot-sk-d4s1", tf(4, 1, true, false, true, 0)},
                            {"DMA-rot", tf(1, 0, false, false, true, 0)},
                            {"DMA-ceil", [] { Policy p = Policy::plain(); p.scale_rule = ScaleRule::ceil; return p; }()},
                            {"DMA-ocp", [] { Policy p = Policy::plain(); p.scale_rule = ScaleRule::ocp; return p; }()},
                            {"DMA-rot-sk-sink-d4s1", tf(4, 1, true, false, true, 1)},
                            {"DMA-all", tf(1, 0, true, true, true, 1)},
                            {"DMA-all-d4s1", tf(4, 1, true, true, true, 1)},
                            {"DMA-d4s1", tf(4, 1, false, false, false, 0)},
                            {"DMA-d8s1", tf(8, 1, false, false, false, 0)},
                            {"all-MXFP8", Policy::all(Format::mxfp8_e4m3)},
                            {"all-MXFP4", Policy::all(Format::mxfp4)},
                            {"DMA-pv-fp8", pv_fp8},
                            {"DMA-NVFP4", Policy::tiles(Format::mxfp8_e4m3, Format::nvfp4, 1, 0)}};
  // DMATTN_BENCH_WINDOW=LEFT: a causal sliding window of LEFT keys before each query (names get -wLEFT;
  // the TFLOP/s column still counts the whole causal square, so it reads as the speed-up).
  const char* window_env = std::getenv("DMATTN_BENCH_WINDOW");
  const int64_t window = window_env ? std::atoll(window_env) : -1;
  const std::string wname = window >= 0 ? "-w" + std::to_string(window) : "";
  const char* queued_env = std::getenv("DMATTN_BENCH_QUEUED");
  const bool queued = queued_env && std::string(queued_env) == "1";
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<const Named*> run;
  for (size_t at = 0; at < order.size();) {  // the named policies, in the order given
    const size_t end = std::min(order.find(',', at), order.size());
    const std::string name = order.substr(at, end - at);
    const auto it = std::find_if(std::begin(policies), std::end(policies), [&](const Named& n) { return name == n.name; });
    if (it == std::end(policies)) {
      std::fprintf(stderr, "unknown policy '%s'\n", name.c_str());
      return 2;
    }
    run.push_back(it);
    at = end + 1;
  }
  if (order.empty())
    for (const Named& pol : policies) run.push_back(&pol);
  for (const Named* named : run) {
    const Named& pol = *named;
    AttentionOptions o;
    o.causal = true;
    o.policy = pol.policy;
    o.check_finite = check;
    o.window_left = window;
    attention(q, k, v, out, nullptr, o);  // warm-up
    std::vector<float> ms(static_cast<size_t>(iters));
    std::vector<double> host(ms.size());
    for (size_t i = 0; i < ms.size(); ++i) {
      if (queued) spin<<<1, 1>>>(4'000'000);
      cudaEventRecord(a);
      const auto t0 = std::chrono::steady_clock::now();
      attention(q, k, v, out, nullptr, o);
      host[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      cudaEventElapsedTime(&ms[i], a, b);
    }
    std::sort(ms.begin(), ms.end());
    std::sort(host.begin(), host.end());
    const double med = ms[ms.size() / 2];
    std::printf("dmattn %s%s%s%s %lld %lld %.4f %.1f\n", pol.name, wname.c_str(), check ? "" : "-nocheck", queued ? "-queued" : "", (long long)N,
                (long long)d, med, flops / med / 1e9);
    std::fprintf(stderr, "host-us %s%s %lld %.1f\n", pol.name, check ? "" : "-nocheck", (long long)N, host[host.size() / 2]);
  }
  return 0;
}
