#!/usr/bin/env bash
# Hybrid speculation with per-position states on the H200 (runner/positions.py): a random
# Qwen3.5 ~2B shape (bf16 weights) — the load check's verdicts in bf16 (batched layout,
# per-position states), then speculation at 4 streams with half the oracle's proposals wrong,
# per-position states against the replaying path (TANDEM_STATE_POSITIONS=0), and with all of
# them right. The speculation runs compute in float32 (DTYPE): the oracle proposes what
# speculation off generated, and in bf16 a verify batch rounds differently, so a stream parts
# from that text within 14-36 tokens and every later proposal is wrong (an H100 run at
# a809122: 27% accepted where half should be; docs/benchmarks/h100-positions/).
#
# Stage once here:   bash scripts/gpu_stage_serving.sh
# Device call 1 (carry .gpu/a):  mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):  source .gpu/b/install.sh && PART=1 bash scripts/h200_positions.sh
# Device call 3 (warm machine):  export PYTHONPATH=/tmp/site:$PWD && PART=2 bash scripts/h200_positions.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
PART=${PART:-1}
m=/tmp/hyb
mkdir -p "$OUT"
spec() {  # P, name, extra env
  timeout 170 env $3 "$PY" -m tandem.cli bench speculative --model "$m/qwen3.5-2b" \
    --workloads random --streams 4 --num-tokens 4 --prompt-tokens 256 --max-tokens 64 \
    --repeats 1 --dtype "${DTYPE:-float32}" --oracle "$1" --json "$OUT/positions-$2-oracle$1.json" 2>&1 \
    | grep -E "^\||rror" | tail -4
}
if [[ $PART == 1 ]]; then
  [ -d $m/qwen3.5-2b ] || "$PY" -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('qwen3.5-2b', 'bfloat16', Path('$m'))" >/dev/null 2>&1
  timeout 150 "$PY" -c "
import logging; logging.basicConfig(level=logging.WARNING)
from tandem import LLM
r = LLM('$m/qwen3.5-2b', dtype='bfloat16', max_num_seqs=16, speculative='ngram').engine.loop.runner
from tandem.runner import gated_delta as g
print('batch_sequences', r.batch_sequences, 'own_recurrence', r.own_recurrence, 'state_positions', r.state_positions, 'one-launch verify states', g._checked.get('each'))" 2>&1 | tail -4
  echo "== P=0.5 per-position"; spec 0.5 held ""
  echo "== P=0.5 replaying"; spec 0.5 replay TANDEM_STATE_POSITIONS=0
fi
if [[ $PART == 2 ]]; then
  echo "== P=1 per-position"; spec 1 held ""
  echo "== P=1 replaying"; spec 1 replay TANDEM_STATE_POSITIONS=0
fi
