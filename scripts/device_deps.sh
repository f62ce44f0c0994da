#!/usr/bin/env bash
# Copies the header/source dependencies the GPU machine lacks (it cannot install packages) into
# .deps/ (git-ignored), to travel with a device call (`carry: [".deps"]`). Not committed anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
dpkg -s googletest >/dev/null 2>&1 || apt-get install -y -qq googletest
rm -rf .deps && mkdir -p .deps/include
cp -r /usr/include/CLI .deps/include/
cp -r /usr/src/googletest .deps/googletest
# The SageAttention baseline of bench/compare_sdpa.py (pure Python + Triton; the device has torch and
# triton but no internet). Pinned; the benchmark runs without it if the download fails here.
mkdir -p .deps/wheels
python3 -m pip download -q --no-deps --only-binary=:all: -d .deps/wheels sageattention==1.0.6 \
  || echo "sageattention wheel not fetched: compare_sdpa.py will report it unavailable"
du -sh .deps
