#!/usr/bin/env bash
# Builds, here, the binaries that `PREBUILT=DIR QUICK=1 bash bench/device.sh` runs on the device (sm_90a),
# and copies them to DIR (default build-prebuilt; carry it, and .deps for the SageAttention wheel).
# A carried build spares the device's time budget the ~100 s build.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-prebuilt}
cmake -S . -B build-sm90 -G Ninja -DDMATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DDMATTN_DEPS="$PWD/.deps" >/dev/null
cmake --build build-sm90 --target dmattn_cli bench_prefill_cuda bench_decode_cuda bench_quantize_cuda bench_wgmma_cuda bench_chains_cuda dmattn_gpu_tests
mkdir -p "$dir/bench" "$dir/tests"
cp build-sm90/dmattn "$dir/"
cp build-sm90/bench/bench_prefill_cuda build-sm90/bench/bench_decode_cuda build-sm90/bench/bench_quantize_cuda build-sm90/bench/bench_wgmma_cuda build-sm90/bench/bench_chains_cuda "$dir/bench/"
cp build-sm90/tests/dmattn_gpu_tests "$dir/tests/"
du -sh "$dir"
