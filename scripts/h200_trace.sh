#!/bin/bash
# One device call (after the staging call): gpt-oss determinism under the overlap with CUDA
# graphs on and off (scripts/h200_oss_trace.py), then the window group's benchmark.
export PYTHONPATH=/tmp/site:$PWD
python -c "import mlx.core as mx; print(mx.default_device())"
t0=$SECONDS
timeout 240 python scripts/h200_oss_trace.py > "$OUT/trace-graphs.jsonl" 2> "$OUT/trace-graphs.err"
echo "trace (graphs on) rc=$? $((SECONDS - t0)) s"
MLX_USE_CUDA_GRAPHS=0 timeout 120 python scripts/h200_oss_trace.py oss,oss-no-moe \
  > "$OUT/trace-nographs.jsonl" 2> "$OUT/trace-nographs.err"
echo "trace (graphs off) rc=$? $((SECONDS - t0)) s"
left=$((560 - SECONDS))
[ "$left" -gt 60 ] && timeout "$left" python -m tandem.bench.window_pages --shape gemma3-1b \
  --dtype bfloat16 --requests 32 --prompt-len 4096 --output-len 128 --kv-mib 900 \
  --max-num-seqs 32 --json "$OUT/window-gemma3-1b.json" > "$OUT/window.log" 2>&1
echo "window bench rc=$? $((SECONDS - t0)) s"
