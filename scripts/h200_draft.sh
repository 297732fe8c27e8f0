#!/bin/bash
# Draft-model speculation on the H200: a random Qwen3-8B-shape target whose layers 4.. are
# damped, drafted for by its own first 4 layers (agreement measured) and by a random
# Qwen3-0.6B shape (agrees by chance only); Tandem off / K=2 / K=4 at 1, 4 and 64 streams,
# and mlx-lm's speculative_generate_step with the same drafts at one stream. JSON under $OUT.
#
# Stage once here:   bash scripts/gpu_stage_serving.sh
# Device call 1 (carry .gpu/a):  mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):  source .gpu/b/install.sh && PARTS=models,early bash scripts/h200_draft.sh
# Device call 3:  export PYTHONPATH=/tmp/site:$PWD; PARTS=random bash scripts/h200_draft.sh
# Environment: PARTS [models,early,random], DAMPING [0.015], STREAMS [1,4,64], KS [2,4],
# TAG (appended to the JSON names), and EXTRA: more `bench speculative` options
# (e.g. "--compile-decode 0", "--speculative-min-gain 0").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
PAIR=${PAIR:-/tmp/pair}
PARTS=${PARTS:-models,early,random}
DAMPING=${DAMPING:-0.015}
STREAMS=${STREAMS:-1,4,64}
KS=${KS:-2,4}
TAG=${TAG:-}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
if [[ $PARTS == *models* ]]; then
  time timeout 300 "$PY" -m tandem.bench.draft_model --shape qwen3-8b --layers 4 \
    --damping "$DAMPING" --random-draft qwen3-0.6b --out "$PAIR"
fi
run() {  # $1: draft folder, $2: name, $3: streams
  timeout 420 "$PY" -m tandem.cli bench speculative --model "$PAIR/target" \
    --draft-model "$PAIR/$1" --workloads random --streams "$3" --num-tokens "$KS" \
    --prompt-tokens 256 --max-tokens 128 --repeats 3 --mlx-lm --json "$OUT/$2$TAG.json" $EXTRA \
    2>&1 | grep -v Warning | tail -14
}
[[ $PARTS == *early* ]] && run draft-4 draft-early-exit "$STREAMS"
[[ $PARTS == *random* ]] && run draft-random draft-random-0.6b 1,64
exit 0
