#!/bin/bash
# Large batches on the GPU (issue 16: B = 256 at 0.71 of the plain-loop ceiling): where a
# steady decode step's time goes at B = 256 on the Qwen3-0.6B shape, uncompiled (the default
# past static_decode.GPU_ROWS) and compiled, then offline runs of both with mlx-lm and the
# ceiling. JSON under $OUT.
#
# Device call (after staging, see scripts/h200_draft.sh):
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/h200_rows.sh
# Environment: SHAPE [qwen3-0.6b], BATCH [256], ROWS [256] (compile_decode of the compiled
# runs), PARTS [profile,offline].
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
SHAPE=${SHAPE:-qwen3-0.6b}
BATCH=${BATCH:-256}
ROWS=${ROWS:-256}
PARTS=${PARTS:-profile,offline}
mkdir -p "$OUT"
compiled="{\"compile_decode\": $ROWS}"
if [[ $PARTS == *profile* ]]; then
  for opts in '{}' "$compiled"; do
    tag=$([ "$opts" = '{}' ] && echo default || echo "compiled$ROWS")
    timeout 240 "$PY" -m tandem.bench.step_profile --shape "$SHAPE" --dtype bfloat16 \
      --batch "$BATCH" --input-len 256 --steps 64 --engine-options "$opts" \
      --json "$OUT/profile-$SHAPE-b$BATCH-$tag.json" 2>&1 | grep -v Warning | grep "B="
  done
fi
if [[ $PARTS == *offline* ]]; then
  for opts in '{}' "$compiled"; do
    tag=$([ "$opts" = '{}' ] && echo default || echo "compiled$ROWS")
    timeout 240 "$PY" -m tandem.cli bench offline --shape "$SHAPE" --dtype bfloat16 \
      --batch-sizes "$BATCH" --input-len 256 --output-len 256 --single-tokens 16 --repeats 1 \
      --overlap-batch 0 --ceiling --engine-options "$opts" \
      --json "$OUT/offline-$SHAPE-b$BATCH-$tag.json" 2>&1 | grep -v Warning | tail -6
  done
fi
exit 0
