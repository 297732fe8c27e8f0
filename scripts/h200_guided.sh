#!/bin/bash
# Guided decoding on the H200: `tandem.bench.guided_mix` (no / half / all rows constrained by a
# JSON schema, overlap on and off) on a random-weight Qwen3-0.6B-shaped bf16 model, batches 16
# and 64. Results under $OUT/guided/.
#
# Stage once on the dev machine:   bash scripts/gpu_stage_serving.sh
# Device call 1 (carry .gpu/a):    mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):    source .gpu/b/install.sh && bash scripts/h200_guided.sh
# Environment: BATCHES ["16 64"], TOKENS [128], REPEATS [3], SHAPE [qwen3-0.6b], DTYPE [bfloat16]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
SHAPE=${SHAPE:-qwen3-0.6b}
DTYPE=${DTYPE:-bfloat16}
MODEL_DIR=${MODEL_DIR:-/tmp/h200_models/$SHAPE-$DTYPE}
if [ ! -f "$MODEL_DIR/.complete" ]; then
  rm -rf "$MODEL_DIR" "$MODEL_DIR.tmp"
  "$PY" -c "
import sys; from pathlib import Path
from tandem.bench.offline import make_model
d = Path(sys.argv[3]); make_model(sys.argv[1], sys.argv[2], Path(str(d) + '.tmp')).rename(d)
(d / '.complete').touch()" "$SHAPE" "$DTYPE" "$MODEL_DIR"
fi
mkdir -p "$OUT/guided"
for b in ${BATCHES:-16 64}; do
  "$PY" -m tandem.bench.guided_mix --model "$MODEL_DIR" --batch "$b" \
    --tokens "${TOKENS:-128}" --repeats "${REPEATS:-3}" --out "$OUT/guided/batch$b.json"
done
