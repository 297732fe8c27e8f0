#!/bin/bash
# Tandem vs mlx_lm.server on the H200 device machine: `tandem bench compare` on a random-weight
# Qwen3-0.6B-shaped bf16 model (built here: the device has no network), results under $OUT.
#
# Stage once on the dev machine:   bash scripts/gpu_stage_serving.sh
# Device call 1 (carry .gpu/a):    mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):    source .gpu/b/install.sh && DATASETS=random bash scripts/h200_compare.sh
# Device call 3 (same warm machine, nothing carried):
#   export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && DATASETS=shared-prefix bash scripts/h200_compare.sh
#
# Environment (defaults in brackets):
#   DATASETS      random | shared-prefix | random,shared-prefix            [random]
#   CONC          concurrency levels                                      [1,4,16,64]
#   REPEATS       repeats per point, alternating the server order         [3]
#   INPUT_LEN     prompt tokens (shared-prefix: suffix tokens)   [256 random, 128 shared-prefix]
#   OUTPUT_LEN    output tokens per request (EOS ignored)                 [128]
#   PREFIX_LEN, NUM_PREFIXES   shared-prefix pool                         [2048, 8]
#   SERVERS       tandem,mlx_lm or one of them                            [tandem,mlx_lm]
#   TANDEM_ARGS, MLX_LM_ARGS   appended to each server's command line     []
#   TANDEM_KV_TOKENS  Tandem's KV pool, unless TANDEM_ARGS sets --kv-budget-tokens: both
#                 servers stay up through the sweep, and Tandem's default (half the free
#                 memory) left mlx_lm.server out of memory at 64 streams on an 80 GB H100 [131072]
#   PROMPTS_PER_CONCURRENCY    requests per run = max(8, this x concurrency)   [2]
#   NAME          output folder under $OUT                                [compare-$DATASETS]
#   BUDGET_S      seconds for this script (model build included); the sweep then stops,
#                 keeping the points it finished in results.json and table.md      [480]
#   MODEL_DIR     use this model instead of building one (e.g. a tiny one for a local test)
#   SHAPE, DTYPE  the model to build: qwen3-0.6b | qwen3-8b | smollm2-135m | tiny  [qwen3-0.6b, bfloat16]
#   PYTHON        [python3]
#   OUT           where results go (the device sets it)                   [/tmp/h200_out]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
DATASETS=${DATASETS:-random}
case "$DATASETS" in
  random) INPUT_LEN=${INPUT_LEN:-256} ;;
  *) INPUT_LEN=${INPUT_LEN:-128} ;;
esac
NAME=${NAME:-compare-${DATASETS//,/+}}
SHAPE=${SHAPE:-qwen3-0.6b}
DTYPE=${DTYPE:-bfloat16}
commit=$(cat .gpu/b/tandem_commit /tmp/gpu/tandem_commit 2>/dev/null | head -1 || true)
export TANDEM_GIT_COMMIT=${TANDEM_GIT_COMMIT:-$commit}  # recorded in results.json (no .git here)
if [ -f .gpu/b/tandem_commit ] && [ -d /tmp/gpu ]; then cp .gpu/b/tandem_commit /tmp/gpu/; fi

t0=$(date +%s)
if ! "$PY" -c "import mlx.core, mlx_lm, fastapi, uvicorn, zmq, httpx, tandem" 2>/dev/null; then
  echo "h200_compare: the serving stack does not import; run 'source .gpu/b/install.sh' first" >&2
  echo "  (or, on a machine that already ran it: export PYTHONPATH=/tmp/site:\$PWD)" >&2
  exit 2
fi
"$PY" -c "import mlx.core as mx; print('h200_compare: mlx', mx.__version__, mx.default_device())"

if [ -z "${MODEL_DIR:-}" ]; then
  MODEL_DIR=/tmp/h200_models/$SHAPE-$DTYPE
  if [ ! -f "$MODEL_DIR/.complete" ]; then
    rm -rf "$MODEL_DIR"
    "$PY" - "$SHAPE" "$DTYPE" "$MODEL_DIR" <<'EOF'
import sys
import time
from pathlib import Path

from tandem.bench.offline import make_model

shape, dtype, dest = sys.argv[1], sys.argv[2], Path(sys.argv[3])
t = time.perf_counter()
path = make_model(shape, dtype, dest.parent / (dest.name + ".tmp"))
path.rename(dest)
(dest / ".complete").touch()
print(f"h200_compare: built {shape} {dtype} in {time.perf_counter() - t:.1f} s: {dest}")
EOF
    rm -rf "$MODEL_DIR.tmp"
  fi
fi

case " ${TANDEM_ARGS:-} " in
  *" --kv-budget-tokens "* | *" --kv-budget-tokens="*) ;;
  *) TANDEM_ARGS="${TANDEM_ARGS:-} --kv-budget-tokens ${TANDEM_KV_TOKENS:-131072}" ;;
esac
mkdir -p "$OUT/$NAME"
left=$((${BUDGET_S:-480} - ($(date +%s) - t0)))
set -x
set +e
timeout -s TERM -k 40 "$left" "$PY" -m tandem.cli bench compare \
  --model "$MODEL_DIR" \
  --out "$OUT/$NAME" \
  --servers "${SERVERS:-tandem,mlx_lm}" \
  --datasets "$DATASETS" \
  --concurrency "${CONC:-1,4,16,64}" \
  --repeats "${REPEATS:-3}" \
  --input-len "$INPUT_LEN" \
  --output-len "${OUTPUT_LEN:-128}" \
  --prefix-len "${PREFIX_LEN:-2048}" \
  --num-prefixes "${NUM_PREFIXES:-8}" \
  --prompts-per-concurrency "${PROMPTS_PER_CONCURRENCY:-2}" \
  --tandem-args="${TANDEM_ARGS:-}" \
  --mlx-lm-args="${MLX_LM_ARGS:-}"
rc=$?
set +x
if [ $rc = 124 ] || [ $rc = 137 ]; then
  echo "h200_compare: BUDGET_S reached: results.json/table.md hold the points finished so far"
  rc=3
fi
echo "h200_compare: exit $rc after $(($(date +%s) - t0)) s; results in $OUT/$NAME"
[ -f "$OUT/$NAME/table.md" ] && cat "$OUT/$NAME/table.md"
exit $rc
