#!/bin/bash
# Where the host's time goes in a steady decode step on the GPU, sampled (py-spy, Python and
# native frames), beside the step profiler's phases; then the B = 256 ramp and the new-prompt
# batching check on the device. Files under $OUT; read the samples here with
# `python scripts/spy_summary.py $OUT/spy-*.txt`.
#
# Device call 1 (carry .gpu/a, with the py-spy wheel copied into it):
#   mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; bash scripts/h200_host_spy.sh
# Environment: SHAPE [qwen3-0.6b], BATCH [256], PARTS [gil,check,spy,ramp,long].
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
SHAPE=${SHAPE:-qwen3-0.6b}
BATCH=${BATCH:-256}
PARTS=${PARTS:-gil,check,spy,ramp,long}
mkdir -p "$OUT"
quiet() { grep -v -i "warning\|regex"; }
SPY=/tmp/pyspy/py_spy-0.4.3.data/scripts/py-spy
if [ ! -x "$SPY" ] && ls /tmp/gpu/py_spy-*.whl > /dev/null 2>&1; then
  mkdir -p /tmp/pyspy && (cd /tmp/pyspy && python3 -m zipfile -e /tmp/gpu/py_spy-*.whl .) \
    && chmod +x "$SPY"
fi
if [[ $PARTS == *gil* ]]; then
  echo "== GIL during async_eval"
  timeout 60 "$PY" scripts/gpu_gil_probe.py 2>&1 | quiet | tail -3
fi
if [[ $PARTS == *check* ]]; then
  echo "== batched new prompts, device check"
  timeout 90 "$PY" scripts/gpu_batched_prefill_check.py 2>&1 | quiet | tail -12
fi
if [[ $PARTS == *spy* ]]; then
  for opts in '{}' '{"compile_decode": 256}'; do
    tag=$([ "$opts" = '{}' ] && echo default || echo compiled)
    echo "== py-spy, $SHAPE B=$BATCH $tag"
    prof=("$PY" -m tandem.bench.step_profile --shape "$SHAPE" --dtype bfloat16 --batch "$BATCH"
      --input-len 256 --steps 192 --engine-options "$opts" --json "$OUT/profile-$tag.json")
    if [ -x "$SPY" ]; then
      timeout 150 "$SPY" record -r 2000 --nonblocking -f raw -o "$OUT/spy-$tag.txt" -- \
        "${prof[@]}" 2>&1 | quiet | grep "B=\|py-spy>" \
        || timeout 150 "${prof[@]}" 2>&1 | quiet | grep "B="
    else
      timeout 150 "${prof[@]}" 2>&1 | quiet | grep "B="
    fi
  done
fi
if [[ $PARTS == *ramp* ]]; then
  echo "== ramp"
  timeout 200 "$PY" -m tandem.bench.ramp --shape "$SHAPE" --batch "$BATCH" --budgets 2048 \
    --unbatched-too --json "$OUT/ramp.json" 2>&1 | quiet | tail -8
fi
if [[ $PARTS == *long* ]]; then
  echo "== 8B, 4 x 32k after a prefix hit"
  timeout 240 "$PY" -m tandem.bench.step_profile --shape qwen3-8b --dtype bfloat16 --batch 4 \
    --input-len 32768 --steps 64 --cache-prompts --json "$OUT/profile-8b-4x32k.json" 2>&1 \
    | quiet | grep "B="
fi
exit 0
