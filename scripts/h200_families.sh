#!/bin/bash
# Model families on the H200: random-weight real small shapes of a hybrid recurrent model
# (Qwen3.5 ~2B: Gated DeltaNet + attention every 4th layer) and a sliding-window model
# (Gemma 3 1B: windows of 512, a global layer every 6th), bf16. Results as JSON/markdown
# under $OUT.
#
# Stage once here:   bash scripts/gpu_stage_serving.sh
# Device call 1 (carry .gpu/a):  mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/
# Device call 2 (carry .gpu/b):  source .gpu/b/install.sh && PART=offline bash scripts/h200_families.sh
# Device call 3 (warm machine):  export PYTHONPATH=/tmp/site:$PWD && PART=serve bash scripts/h200_families.sh
#
# PART=offline: `tandem bench offline` (B = 1, 16, 64; Tandem vs mlx-lm's generate_step and
#   batch_generate in one process) for each of SHAPES.
# PART=hybrid: the batched (B, n) calls of hybrids: bf16 load check, equal prompts' prefill,
#   speculation at 4 streams (oracle proposals right with P = 1 and 0.5).
# PART=oss: the gpt-oss-20b shape (42 GB in bf16), offline B = 1, 16, 64 (one repeat).
# PART=serve: `tandem bench compare` vs mlx_lm.server for SERVE_SHAPE: random 256 in / 128
#   out at 1, 16, 64 streams, then multi-turn conversations (4 turns, TTFT and cached share
#   per turn).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/h200_out}
PART=${PART:-offline}
SHAPES=${SHAPES:-qwen3.5-2b gemma3-1b}
mkdir -p "$OUT"
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
if [[ $PART == offline ]]; then
  "$PY" -c "import tandem.runner.gated_delta as g; print('gated delta kernel:', g.available())"
  for shape in $SHAPES; do
    timeout 360 "$PY" -m tandem.cli bench offline --shape "$shape" --dtype bfloat16 \
      --batch-sizes 16,64 --input-len 256 --output-len 128 --single-tokens 128 \
      --repeats "${REPEATS:-2}" --overlap-batch 0 --json "$OUT/offline-$shape.json" 2>&1 | tail -8
  done
fi
if [[ $PART == hybrid ]]; then
  # Segments of one length sharing (B, n) calls (runner/recurrent_step.py): the load check's
  # verdict in bf16, equal prompts' prefill shared vs one call each, speculation at 4 streams.
  m=/tmp/hyb; "$PY" -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('qwen3.5-2b', 'bfloat16', Path('$m'))" >/dev/null 2>&1
  timeout 120 "$PY" -c "
from tandem import LLM
r = LLM('$m/qwen3.5-2b', dtype='bfloat16', max_num_seqs=16).engine.loop.runner
print('batch_sequences', r.batch_sequences, 'own_recurrence', r.own_recurrence)" 2>&1 | tail -3
  timeout 150 "$PY" scripts/hybrid_prefill_bench.py "$m/qwen3.5-2b" 16 256 2 2>&1 | tail -3
  for P in 1 0.5; do
    timeout 150 "$PY" -m tandem.cli bench speculative --model "$m/qwen3.5-2b" --workloads random \
      --streams 4 --num-tokens 4 --prompt-tokens 256 --max-tokens 64 --repeats 1 \
      --dtype bfloat16 --oracle $P --json "$OUT/hybrid-spec-oracle$P.json" 2>&1 | grep "^|"
  done
fi
if [[ $PART == oss ]]; then
  m=/tmp/m20/gpt-oss-20b
  [ -f $m/config.json ] || "$PY" -c "
import time; from pathlib import Path; from tandem.bench.offline import make_model
t = time.perf_counter(); make_model('gpt-oss-20b', 'bfloat16', Path('/tmp/m20'))
print(f'built gpt-oss-20b in {time.perf_counter() - t:.0f} s')"
  timeout ${OSS_TIMEOUT:-480} "$PY" -m tandem.cli bench offline --model $m --dtype bfloat16 \
    --batch-sizes "${OSS_BATCHES:-16,64}" --input-len 256 --output-len 128 --single-tokens 128 \
    --repeats 1 --overlap-batch 0 --json "$OUT/offline-gpt-oss-20b.json" 2>&1 \
    | grep -v "^\[transformers\]" | tail -12
fi
if [[ $PART == serve ]]; then
  shape=${SERVE_SHAPE:-qwen3.5-2b}
  SHAPE=$shape DATASETS=random CONC=${CONC:-1,16,64} REPEATS=${REPEATS:-2} \
    NAME=compare-$shape-random BUDGET_S=${RANDOM_BUDGET_S:-300} bash scripts/h200_compare.sh
  SHAPE=$shape DATASETS=multi-turn CONC=${TURN_CONC:-8} REPEATS=${REPEATS:-2} \
    NAME=compare-$shape-multi-turn BUDGET_S=${TURN_BUDGET_S:-200} \
    bash scripts/h200_compare.sh
fi
