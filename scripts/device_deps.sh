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
du -sh .deps
