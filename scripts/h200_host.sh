#!/bin/bash
# Issue 16 on the H200: in-place KV writes checked token for token, then where a decode step's
# host time goes on the Qwen3-8B shape with and without them, and with compiled decode steps. After staging
# (scripts/gpu_stage_serving.sh, its two device calls), in the second call or later:
#   export PYTHONPATH=/tmp/site:$PWD; PARTS="check profile offline http" bash scripts/h200_host.sh DIR
# (PARTS also: crossover, fused, rope, determinism, single, hybrid, views, viewsexact, hybridc, pool, ops.) SHAPE=qwen3-0.6b (a bench shape) instead of the 8B one
# (for the fused part's files, named by the shape; the others keep "8b" in their names).
set -u
out=${1:-${OUT:-/tmp}/host}
parts=${PARTS:-check profile}
shape=${SHAPE:-qwen3-8b}
mkdir -p "$out"
m=/tmp/m8/$shape
model() {
  [ -d $m ] || python3 -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('$shape', 'bfloat16', Path('/tmp/m8'))"
}
for part in $parts; do
  case $part in
  check)
    timeout 400 python3 scripts/gpu_inplace_check.py "$out/inplace_check.json" > "$out/inplace_check.log" 2>&1
    grep -v "^\[transformers\]" "$out/inplace_check.log" | tail -25 ;;
  profile)
    model
    for o in on off compiled; do
      opt='{"compile_decode": 0}'; [ $o = off ] && opt='{"compile_decode": 0, "kv_inplace_writes": false}'
      [ $o = compiled ] && opt='{"compile_decode": true}'
      timeout 300 python3 -m tandem.bench.step_profile --model $m --dtype bfloat16 --batch 1,16 \
        --input-len 128 --steps 128 --engine-options "$opt" --json "$out/profile-8b-inplace-$o.json" \
        2>&1 | grep -v "^\[transformers\]" | cut -c1-700
    done ;;
  crossover)
    # Where compiled steps stop paying (--compile-decode ROWS): step time by row count.
    model
    for o in plain compiled; do
      opt='{"compile_decode": 0}'; [ $o = compiled ] && opt='{"compile_decode": true}'
      timeout 240 python3 -m tandem.bench.step_profile --model $m --dtype bfloat16 --batch 1,2,4,8 \
        --input-len 128 --steps 64 --engine-options "$opt" --json "$out/crossover-8b-$o.json" \
        2>&1 | grep -v "^\[transformers\]" | cut -c1-400
    done ;;
  offline)
    model
    for o in compiled on off; do
      opt='{"compile_decode": 0}'; [ $o = off ] && opt='{"compile_decode": 0, "kv_inplace_writes": false}'
      [ $o = compiled ] && opt='{"compile_decode": true}'
      timeout 280 python3 -m tandem.cli bench offline --model $m --dtype bfloat16 --batch-sizes 16,64 \
        --input-len 128 --output-len 128 --single-tokens 256 --repeats 2 --overlap-batch 0 \
        --engine-options "$opt" --json "$out/offline-8b-inplace-$o.json" 2>&1 | grep -v "^\[transformers\]" | tail -8
    done ;;
  fused)
    # runner/fused_proj.py: q/k/v and gate/up in one matmul. Step time at 1 and 16 rows:
    # off, fused up to 1 row (16 rows are the control), fused up to 16 rows (strided slices);
    # the offline single stream off and on; then the first token where bf16 output differs.
    model
    for f in 0 1 16; do
      timeout 200 python3 -m tandem.bench.step_profile --model $m --dtype bfloat16 --batch 1,16 \
        --input-len 128 --steps 128 --engine-options "{\"fuse_projections\": $f}" \
        --json "$out/fused-profile-$shape-$f.json" \
        2>&1 | grep "overlap=on" | cut -c1-300
    done
    for f in 0 1; do
      timeout 200 python3 -m tandem.cli bench offline --model $m --dtype bfloat16 --batch-sizes "" \
        --single-tokens 256 --repeats 3 --overlap-batch 0 --engine-options "{\"fuse_projections\": $f}" \
        --json "$out/fused-offline-$shape-$f.json" 2>&1 | grep "single stream"
    done
    timeout 200 python3 scripts/fused_divergence.py $m "$out/fused-divergence-$shape.json" 2>&1 | tail -3 ;;
  http)
    # Item 5: the engine's step time in the server vs offline, CPU per token of the HTTP
    # process (random Qwen3-0.6B shape; the GGUF default model is not on the device).
    python3 -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('qwen3-0.6b', 'bfloat16', Path('/tmp/m06'))"
    timeout 400 python3 -m tandem.bench.http_overhead --model /tmp/m06/qwen3-0.6b \
      --concurrency 1,16,64,256 --output-len 64 --json "$out/http-0.6b.json" 2>&1 \
      | grep -v "^\[transformers\]" | tail -5 ;;
  rope)
    # MLX's CUDA rope fault and Tandem's guard (runner/mlx_compat.py): the sweep without and
    # with it, and a partial-rotary gpt_neox against mlx-lm in unchunked multi-prompt steps.
    (cd scripts && timeout 200 python3 -u gpu_partial_rope.py) 2>&1 | grep -v "^\[transformers\]" \
      | tee "$out/partial-rope.txt" | tail -12 ;;
  determinism)
    # gpt_oss: Tandem's engines and mlx-lm twice, with MLX's buffer cache on and off.
    for c in on off; do
      l=""; [ $c = off ] && l=1
      (cd scripts && CACHE_LIMIT0=$l timeout 240 python3 -u gpu_determinism.py) 2>&1 \
        | grep -v "^\[transformers\]" | tee "$out/determinism-cache-$c.txt" | tail -11
    done ;;
  single)
    # Where the single stream of the hybrid and of Gemma 3 loses (0.52x and 0.63x mlx-lm on
    # an H100, 2026-12-05): phases and graph nodes, overlap on and off.
    for s in qwen3.5-2b gemma3-1b; do
      timeout 280 python3 -u -m tandem.bench.step_profile --shape $s --dtype bfloat16 --batch 1 \
        --input-len 128 --steps 96 --json "$out/profile-single-$s.json" 2>&1 \
        | grep -v "^\[transformers\]" | cut -c1-400
    done ;;
  hybrid)
    # The hybrid at B = 64 (1.20x mlx-lm and 0.54 of the ceiling on 2026-12-06's H100 against
    # 2.04x the day before): the step's phases, and the offline rows, with in-place KV and
    # recurrent states and with MLX's scatters, each in its own process (at most 560 s).
    python3 -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('qwen3.5-2b', 'bfloat16', Path('/tmp/mv'))"
    for o in on off; do
      opt='{}'; [ $o = off ] && opt='{"kv_inplace_writes": false}'
      timeout 140 python3 -m tandem.bench.step_profile --model /tmp/mv/qwen3.5-2b --dtype bfloat16 \
        --batch 16,64 --input-len 256 --steps 64 --engine-options "$opt" \
        --json "$out/profile-hybrid-$o.json" 2>&1 | grep -v "^\[transformers\]" | cut -c1-500
      timeout 140 python3 -m tandem.cli bench offline --model /tmp/mv/qwen3.5-2b --dtype bfloat16 \
        --batch-sizes 64 --input-len 256 --output-len 128 --single-tokens 128 --repeats 2 \
        --overlap-batch 0 --ceiling --engine-options "$opt" --json "$out/offline-hybrid-$o.json" \
        2>&1 | grep "single stream\|B=64"
    done ;;
  views)
    # Linear layers' transposed weights made once (runner/weight_views.py; one graph node
    # fewer per linear call): a single-stream step with and without, in turn, 2 rounds (at
    # most 560 s; the random models are written first, outside the timed runs).
    for s in qwen3-0.6b qwen3.5-2b; do
      python3 -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('$s', 'bfloat16', Path('/tmp/mv'))"
    done
    for r in 1 2; do for v in 0 1; do for s in qwen3-0.6b qwen3.5-2b; do
      TANDEM_WEIGHT_VIEWS=$v timeout 70 python3 -m tandem.bench.step_profile --model /tmp/mv/$s \
        --dtype bfloat16 --batch 1 --input-len 128 --steps 128 \
        --json "$out/views-$s-$v-$r.json" 2>&1 | grep "B=1 " | sed "s/^/views=$v $s /" | cut -c1-300
    done; done; done ;;
  hybridc)
    # Compiled steps on the hybrid (its rows' resident recurrent states as the trace's inputs
    # and outputs): a step of 1 and 4 rows compiled and not, the offline single stream
    # beside mlx-lm each way, and the first bf16 token where compiled output differs.
    python3 -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('qwen3.5-2b', 'bfloat16', Path('/tmp/mv'))"
    for c in 0 def; do
      opt='{}'; [ $c = 0 ] && opt='{"compile_decode": 0}'
      timeout 100 python3 -m tandem.bench.step_profile --model /tmp/mv/qwen3.5-2b --dtype bfloat16 \
        --batch 1,4 --input-len 128 --steps 96 --engine-options "$opt" \
        --json "$out/hybridc-profile-$c.json" 2>&1 | grep "ms/step" | sed "s/^/compile=$c /" | cut -c1-300
      timeout 100 python3 -m tandem.cli bench offline --model /tmp/mv/qwen3.5-2b --dtype bfloat16 \
        --batch-sizes "" --single-tokens 256 --repeats 3 --overlap-batch 0 --engine-options "$opt" \
        --json "$out/hybridc-offline-$c.json" 2>&1 | grep "single stream" | sed "s/^/compile=$c /"
    done
    WHAT=compiled timeout 150 python3 scripts/fused_divergence.py /tmp/mv/qwen3.5-2b \
      "$out/compiled-divergence-qwen3.5-2b.json" 4 128 2>&1 | tail -1 ;;
  viewsexact)
    # The views against none in bf16: the first differing token per prompt, alone and batched
    # (the batch-one views run the same GEMM: none is expected).
    python3 -c "from pathlib import Path; from tandem.bench.offline import make_model; make_model('qwen3-0.6b', 'bfloat16', Path('/tmp/mv'))"
    WHAT=views timeout 300 python3 scripts/fused_divergence.py /tmp/mv/qwen3-0.6b \
      "$out/views-divergence-qwen3-0.6b.json" 4 128 2>&1 | tail -1 ;;
  pool)
    # The KV pool's size (docs/benchmarks.md, "2026-12-06"): an unrelated allocation beside a
    # small pool, then the single stream at three pool sizes, each in its own process.
    model
    timeout 200 python3 scripts/gpu_pool_alloc.py $m 60 2>&1 | grep -v "^\[transformers\]" \
      | tee "$out/pool-alloc-$shape.txt" | tail -2
    for t in 8192 262144 0; do
      opt="{\"kv_budget_tokens\": $t}"; [ $t = 0 ] && opt='{}'
      timeout 150 python3 -m tandem.cli bench offline --model $m --dtype bfloat16 --batch-sizes "" \
        --single-tokens 256 --repeats 3 --interleave off --engine-options "$opt" \
        --json "$out/pool-$shape-$t.json" 2>&1 | grep "single stream"
    done ;;
  ops)
    # MLX's command-buffer size (MLX_MAX_OPS_PER_BUFFER, read once per process): the plain
    # loop and Tandem at batch 1 (scripts/gpu_backpressure.py), twice per value.
    model
    for v in 100 160 400 100 160 400; do
      MLX_MAX_OPS_PER_BUFFER=$v timeout 150 python3 scripts/gpu_backpressure.py $m 2>&1 \
        | tail -1 | tee -a "$out/backpressure-$shape.jsonl"
    done ;;
  esac
done
