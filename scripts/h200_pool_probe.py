"""Single-stream decode rate vs KV pool size and buffer sets, beside mlx-lm (H200 probe).

    python scripts/h200_pool_probe.py MODEL_DIR [tokens:sets ...]

Each config is ``tokens:1`` or ``tokens:2`` (KV pool tokens, buffer sets); mlx-lm's
``generate_step`` runs first, then a hand loop like it with its step phases timed (graph
build, submit). MLX_MAX_MB_PER_BUFFER / MLX_MAX_OPS_PER_BUFFER (MLX's CUDA graph limits) are
read from the environment at start. Results in docs/benchmarks/h200-host/pool-probe/.
"""

import json
import sys
import time

import mlx.core as mx

import tandem.runner  # noqa: F401
from tandem import LLM, SamplingParams

model_dir = sys.argv[1]
configs = sys.argv[2:] or ["8192:1", "200000:1", "200000:2"]
N = 256
prompt = list(range(10, 42))


def mlx_lm_side() -> dict:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(model_dir)
    out = {}
    for rep in range(2):
        t0, n = None, 0
        for _ in generate_step(mx.array(prompt), model, max_tokens=N):
            t0 = t0 or time.perf_counter()
            n += 1
        out[f"tok_s_{rep}"] = (n - 1) / (time.perf_counter() - t0)
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    build = submit = 0.0
    t_all = time.perf_counter()
    for _ in range(N):
        t = time.perf_counter()
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        t2 = time.perf_counter()
        mx.async_eval(nxt)
        build, submit = build + t2 - t, submit + time.perf_counter() - t2
        y.item()
        y = nxt
    out.update(
        loop_tok_s=N / (time.perf_counter() - t_all),
        build_ms=build / N * 1e3,
        submit_ms=submit / N * 1e3,
    )
    return out


def tandem_side(tokens: int, sets: int) -> dict:
    llm = LLM(model_dir, max_num_seqs=8, kv_budget_tokens=tokens, kv_double_buffer=sets == 2)
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    llm.generate([prompt], sp)
    out = {}
    for rep in range(2):
        t0, n = None, 0
        for _ in llm.stream(prompt, sp):
            t0 = t0 or time.perf_counter()
            n += 1
        out[f"tok_s_{rep}"] = (n - 1) / (time.perf_counter() - t0)
    return out


res = {"mlx_lm": mlx_lm_side()}
print(json.dumps({"mlx_lm": res["mlx_lm"]}), flush=True)
for c in configs:
    tokens, sets = (int(x) for x in c.split(":"))
    res[c] = tandem_side(tokens, sets)
    print(json.dumps({c: res[c]}), flush=True)
