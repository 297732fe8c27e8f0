#!/bin/bash
# Paged KV on the H200: the attention kernel microbenchmark, the ragged batch and the offline
# batches (Tandem vs mlx-lm in one process), results as JSON under $OUT.
#
# Stage once here:   bash scripts/gpu_stage_serving.sh
# Device call 1 (carry .gpu/a):  mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):  source .gpu/b/install.sh && bash scripts/h200_paged.sh
# Environment: SHAPE [qwen3-0.6b], PARTS [kernel,ragged,offline], REPEATS [2]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
SHAPE=${SHAPE:-qwen3-0.6b}
PARTS=${PARTS:-kernel,ragged,offline}
REPEATS=${REPEATS:-2}
KERNELS=${KERNELS:-true false}
mkdir -p "$OUT"
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
if [[ $PARTS == *kernel* ]]; then
  timeout 150 "$PY" -m tandem.bench.paged_attention --json "$OUT/paged_attention.json"
fi
if [[ $PARTS == *ragged* ]]; then
  for kern in $KERNELS; do
    timeout 240 "$PY" -m tandem.bench.ragged --shape "$SHAPE" --dtype bfloat16 \
      --repeats "$REPEATS" --engine-options "{\"kv_decode_kernel\": $kern}" \
      --json "$OUT/ragged-$SHAPE-kernel_$kern.json" | tail -30
  done
fi
if [[ $PARTS == *offline* ]]; then
  timeout 300 "$PY" -m tandem.cli bench offline --shape "$SHAPE" --dtype bfloat16 \
    --repeats "$REPEATS" --json "$OUT/offline-$SHAPE.json" | tail -30
fi
