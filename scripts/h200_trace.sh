#!/bin/bash
# One device call (after the staging call): gpt-oss determinism under the overlap, parts of its
# MoE replaced (scripts/h200_oss_trace.py), the window group against mlx-lm; then, as time
# allows, PARTS of scripts/h200_host.sh (default: crossover).
export PYTHONPATH=/tmp/site:$PWD
t0=$SECONDS
timeout 300 python scripts/h200_oss_trace.py ${CASES:-oss,oss-routing-only,oss-experts-only,oss-window,gemma3-window} \
  > "$OUT/trace.jsonl" 2> "$OUT/trace.err"
echo "trace rc=$? $((SECONDS - t0)) s"
# No buffer cache: a buffer freed while a kernel still uses it is not handed out again.
TRACE_CACHE_LIMIT=0 timeout 150 python scripts/h200_oss_trace.py oss > "$OUT/trace-nocache.jsonl" \
  2> "$OUT/trace-nocache.err"
echo "trace (no buffer cache) rc=$? $((SECONDS - t0)) s"
left=$((560 - SECONDS))
[ "$left" -gt 90 ] && PARTS=${PARTS:-crossover} timeout "$left" bash scripts/h200_host.sh "$OUT/host"
echo "host parts rc=$? $((SECONDS - t0)) s"
