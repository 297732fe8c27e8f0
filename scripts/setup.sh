#!/usr/bin/env bash
# Set up Tandem in ./.venv on a fresh machine: the MLX backend for this platform, the package
# and its test tools, and (Linux) an optimized BLAS that Tandem preloads for MLX's CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "$(uname -s)" = "Linux" ]; then
  if [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] \
     && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null
    else
      echo "setup: install libopenblas0-pthread for ~35x faster float32 matmuls on CPU" >&2
    fi
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then BACKEND=cuda; else BACKEND=cpu; fi
else
  BACKEND=metal
fi
BACKEND=${TANDEM_BACKEND:-$BACKEND}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[${BACKEND},test,bench]"
echo "setup: ready (.venv, MLX backend: ${BACKEND})"
