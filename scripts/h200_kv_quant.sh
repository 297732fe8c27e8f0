#!/bin/bash
# Quantized KV on the H200: the decode kernel over float / int8 / int4 pages (one layer), then
# the engine on a random Qwen3 shape at long context (tokens that fit, decode tok/s), results
# as JSON under $OUT.
#
# Stage once here:   bash scripts/gpu_stage_serving.sh
# Device call 1 (carry .gpu/a):  mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):  source .gpu/b/install.sh && bash scripts/h200_kv_quant.sh
# Environment: SHAPE [qwen3-0.6b], CONTEXT [32768], STREAMS [1,4], PARTS [kernel,engine]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
SHAPE=${SHAPE:-qwen3-0.6b}
CONTEXT=${CONTEXT:-32768}
STREAMS=${STREAMS:-1,4}
PARTS=${PARTS:-kernel,engine}
mkdir -p "$OUT"
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
if [[ $PARTS == *kernel* ]]; then
  timeout 120 "$PY" -m tandem.cli bench kv-quant --kernel --context "$CONTEXT" \
    --streams "$STREAMS" --json "$OUT/kv-quant-kernel.json"
fi
if [[ $PARTS == *engine* ]]; then
  timeout 420 "$PY" -m tandem.cli bench kv-quant --shape "$SHAPE" --context "$CONTEXT" \
    --streams "$STREAMS" --max-tokens 64 --repeats 3 --skip-quality \
    --json "$OUT/kv-quant-$SHAPE.json" | tail -8
fi
