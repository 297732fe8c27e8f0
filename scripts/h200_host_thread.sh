#!/bin/bash
# The loop's host work beside the submission (engine/loop.py, ``host_thread``) on the GPU:
# steady decode steps at B = 256 on the Qwen3-0.6B shape with it off and forced on,
# uncompiled and compiled, then the B = 256 end-to-end run (ramp and decode) with it off,
# automatic and forced on, and a single stream with it automatic (which should leave it off;
# the default is off since 2026-12-07). JSON under $OUT.
#
# Device call 1 (carry .gpu/a):  mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):
#   source .gpu/b/install.sh > /tmp/install.log 2>&1; bash scripts/h200_host_thread.sh
# Environment: SHAPE [qwen3-0.6b], BATCH [256], PARTS [profile,ramp,single,long].
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
SHAPE=${SHAPE:-qwen3-0.6b}
BATCH=${BATCH:-256}
PARTS=${PARTS:-profile,ramp,single,long}
mkdir -p "$OUT"
quiet() { grep -v -i "warning\|regex"; }
if [[ $PARTS == *profile* ]]; then
  for compiled in 0 "$BATCH"; do
    for ht in false true; do
      echo "== B=$BATCH compile_decode=$compiled host_thread=$ht"
      timeout 120 "$PY" -m tandem.bench.step_profile --shape "$SHAPE" --dtype bfloat16 \
        --batch "$BATCH" --input-len 256 --steps 96 --overlap-only \
        --engine-options "{\"compile_decode\": $compiled, \"host_thread\": $ht}" \
        --json "$OUT/profile-c$compiled-$ht.json" 2>&1 | quiet | grep "overlap=on"
    done
  done
fi
if [[ $PARTS == *ramp* ]]; then
  for ht in false null true; do
    echo "== ramp, host_thread=$ht"
    timeout 150 "$PY" -m tandem.bench.ramp --shape "$SHAPE" --batch "$BATCH" --budgets 2048 \
      --engine-options "{\"host_thread\": $ht}" --json "$OUT/ramp-$ht.json" 2>&1 | quiet | tail -3
  done
fi
if [[ $PARTS == *single* ]]; then
  echo "== single stream, host_thread automatic"
  timeout 100 "$PY" -m tandem.bench.step_profile --shape "$SHAPE" --dtype bfloat16 --batch 1 \
    --input-len 256 --steps 128 --engine-options '{"host_thread": null}' \
    --json "$OUT/profile-b1.json" 2>&1 | quiet | grep "B="
fi
if [[ $PARTS == *long* ]]; then
  echo "== 8B, 4 x 16k after a prefix hit, overlap off then on in one process (the whole log)"
  timeout 240 "$PY" -m tandem.bench.step_profile --shape qwen3-8b --dtype bfloat16 --batch 4 \
    --input-len 16384 --steps 24 --cache-prompts \
    --json "$OUT/profile-8b-4x16k-on.json" > "$OUT/long.log" 2>&1
  grep -i -n "error\|retract\|recover\|preempt\|evict\|memory\|pool\|fail" "$OUT/long.log" \
    | grep -v -i "warning\|regex" | head -40
  quiet < "$OUT/long.log" | tail -8
fi
exit 0
