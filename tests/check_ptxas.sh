#!/usr/bin/env bash
# Compiles the hot CUDA kernels for sm_90a (no GPU needed) and fails when ptxas reports what would
# silently cost speed: register spills in a kernel, or wgmma instructions it serialises (C7511, C7514, C7515,
# C7520: each wgmma waits for the previous one — a 2x slowdown once seen). Prints the figures.
# usage: check_ptxas.sh NVCC SOURCE_DIR
set -uo pipefail
nvcc=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for f in prefill decode; do
  "$nvcc" -std=c++17 --expt-relaxed-constexpr -DDMATTN_HAVE_CUDA=1 -I"$src/include" -I"$src/src" -O3 \
    -gencode=arch=compute_90a,code=sm_90a -Xptxas=-v -c "$src/src/cuda/$f/kernel.cu" -o "$tmp/$f.o" >"$tmp/$f.log" 2>&1 ||
    { echo "FAILED: $f/kernel.cu does not compile"; cat "$tmp/$f.log"; status=1; continue; }
  # One line per kernel instance: registers and spill bytes.
  awk '/Compiling entry function/ {match($0, /[a-z]+_kernel[A-Za-z0-9_]*/); name = substr($0, RSTART, RLENGTH)}
       /spill stores/ {spill = $5 + $9}
       /Used [0-9]+ registers/ && name != "" {printf "%-56s %4s registers, %s bytes spilled\n", name, $5, spill; name = ""}' \
    "$tmp/$f.log"
  if grep -E "C7511|C7514|C7515|C7520" "$tmp/$f.log"; then echo "FAILED: ptxas serialises wgmma in $f/kernel.cu"; status=1; fi
  if grep -E "[1-9][0-9]* bytes spill stores" "$tmp/$f.log" | grep -q .; then echo "FAILED: register spills in $f/kernel.cu"; status=1; fi
done
[ $status -eq 0 ] && echo "ptxas: no spills, no serialised wgmma (prefill and decode kernels, sm_90a)"
exit $status
