#!/usr/bin/env bash
# Builds, here, the sm_90a binaries of several git refs (each from its own worktree, laid out as
# bench/prebuild.sh lays out build-prebuilt) into build-exp/NAME, and packs their bench/ and tests/ into
# build-exp.tar.xz: about 3 MB a build, so one device call can carry many for an A/B run
# (the working tree that travels is limited to 64 MiB; an unpacked build is ~17 MB).
# usage: bash bench/prebuild_refs.sh NAME=REF[=CUDA_FLAGS] ...
#   e.g. base=main variant=my-branch poly8=my-branch=-DDMATTN_EXP2_POLY_EVERY=8
# On the device (carry build-exp.tar.xz; python3 -m tarfile -e unpacks it where tar lacks xz): tar -xJf build-exp.tar.xz && AB="build-exp/base build-exp/imma" bash bench/device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
packed=()
for spec in "$@"; do
  IFS='=' read -r name ref flags <<<"$spec"
  [ -n "$name" ] && [ -n "$ref" ] || { echo "bad spec '$spec' (want NAME=REF[=CUDA_FLAGS])" >&2; exit 2; }
  wt=$root/.worktrees/$name
  git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
  git worktree add --detach "$wt" "$ref" >/dev/null
  echo "== $name: $(git -C "$wt" log --oneline -1) ${flags:+(CUDA flags $flags)}"
  cmake -S "$wt" -B "$wt/build-sm90" -G Ninja -DDMATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DDMATTN_PYTHON=OFF \
    -DCMAKE_CUDA_FLAGS="${flags:-}" -DDMATTN_DEPS="$root/.deps" >/dev/null
  benches="prefill decode quantize"
  [ -f "$wt/bench/bench_wgmma_cuda.cu" ] && benches="$benches wgmma"  # (older refs lack it)
  [ -f "$wt/bench/bench_chains_cuda.cu" ] && benches="$benches chains"  # (older refs lack it)
  # shellcheck disable=SC2046  # one target a bench
  cmake --build "$wt/build-sm90" --target $(printf 'bench_%s_cuda ' $benches) dmattn_gpu_tests \
    >"$wt.log" 2>&1 || { tail -30 "$wt.log"; echo "$name ($ref) does not build" >&2; exit 1; }
  grep -E "[1-9][0-9]* bytes spill" "$wt.log" || true
  dir=build-exp/$name
  mkdir -p "$dir/bench" "$dir/tests"
  for b in $benches; do cp "$wt/build-sm90/bench/bench_${b}_cuda" "$dir/bench/"; done
  cp "$wt/build-sm90/tests/dmattn_gpu_tests" "$dir/tests/"
  git -C "$wt" log --oneline -1 >"$dir/ref.txt"
  packed+=("$dir")
  git worktree remove --force "$wt"
done
tar -cJf build-exp.tar.xz "${packed[@]}"
ls -la build-exp.tar.xz
