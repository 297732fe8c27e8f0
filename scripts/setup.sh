#!/usr/bin/env bash
# Set up Tandem in ./.venv on a fresh machine: the MLX backend for this platform, the package
# and its test tools, and (Linux) an optimized BLAS that Tandem preloads for MLX's CPU backend.
#
#   --with-browser   also install Chromium (Debian's package) for the browser tests of the web
#                    pages (tests/browser); without it they are skipped, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BROWSER=0
for arg in "$@"; do
  case "$arg" in
    --with-browser) BROWSER=1 ;;
    *) echo "setup: unknown option $arg" >&2; exit 2 ;;
  esac
done
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
if [ "$BROWSER" = 1 ]; then
  if command -v chromium >/dev/null || command -v chromium-browser >/dev/null \
     || [ -n "${TANDEM_CHROMIUM:-}" ]; then
    :
  elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: no Chromium; install it (e.g. apt-get install chromium) for tests/browser" >&2
  fi
fi
echo "setup: ready (.venv, MLX backend: ${BACKEND})"
