"""Where gpt-oss loses determinism with the overlap on the GPU, and the window group token for
token against mlx-lm there. ``python scripts/h200_oss_trace.py [CASES]`` (a comma list of the
names in CASES; MLX_USE_CUDA_GRAPHS and the like are read from the environment).

Each case writes a tiny float32 model (a family's config with overrides, or with one part of the
model replaced in both Tandem and mlx-lm), runs mlx-lm's generate_step once as the reference,
then Tandem with each option set, several passes, and prints per pass the outputs that differ
from mlx-lm and from the case's first pass.
"""

import json  # noqa: I001  (tandem.runner preloads BLAS before mlx)
import os
import random
import sys
import tempfile
from pathlib import Path

import tandem.runner  # noqa: F401
import mlx.core as mx
import mlx_lm.models.gpt_oss as gpt_oss
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from tandem import LLM, SamplingParams
from tandem.testing import families, tiny_models

CHUNK = {"max_num_batched_tokens": 64}
WINDOW_GROUP = {**CHUNK, "kv_page_size": 4, "kv_window_pages": 24}
RUNS = [
    ("overlap", CHUNK, 3),
    ("overlap-one-group", {**CHUNK, "kv_window_pages": 0}, 2),
    ("overlap-off", {**CHUNK, "overlap": False}, 1),
]
WRUNS = [
    ("window", WINDOW_GROUP, 2),
    ("window-overlap-off", {**WINDOW_GROUP, "overlap": False}, 1),
    ("one-group", {**CHUNK, "kv_window_pages": 0}, 1),
]


def dense_mlp(self, x):  # gpt-oss's MoE block replaced by an activation: no routing, no experts
    return x * mx.sigmoid(x)


def routing_only(self, x):  # the router's top-k and softmax, no experts
    values, _ = gpt_oss.mlx_topk(self.router(x), k=self.num_experts_per_tok, axis=-1)
    return x * mx.softmax(values, axis=-1, precise=True).sum(axis=-1, keepdims=True)


def experts_only(self, x):  # the experts (gather_mm, sorted where mlx-lm sorts), fixed routing
    k = self.num_experts_per_tok
    idx = mx.broadcast_to(mx.arange(k, dtype=mx.uint32), (*x.shape[:-1], k))
    return self.experts(x, idx).sum(axis=-2) * 0.5


CASES = {
    "oss": ("gpt_oss", {}, None, RUNS),
    "oss-no-moe": ("gpt_oss", {}, ("MLPBlock", dense_mlp), RUNS),
    "oss-routing-only": ("gpt_oss", {}, ("MLPBlock", routing_only), RUNS),
    "oss-experts-only": ("gpt_oss", {}, ("MLPBlock", experts_only), RUNS),
    "oss-window": ("gpt_oss", {}, None, WRUNS),
    "gemma3-window": ("gemma3_text", {}, None, WRUNS),
}


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


rng = random.Random(0)
prefix = [rng.randrange(5, 500) for _ in range(40)]
prompts = [
    prefix + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 300))] for _ in range(12)
]
ns = [rng.randrange(8, 48) for _ in prompts]
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in ns]
env = {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "TRACE_"))}
if "TRACE_CACHE_LIMIT" in os.environ:  # 0: freed buffers go back to the device at once
    mx.set_cache_limit(int(os.environ["TRACE_CACHE_LIMIT"]))
root = Path(tempfile.mkdtemp())
chosen = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
for case in chosen:
    fam, override, patch, runs = CASES[case]
    saved = None
    if patch is not None:
        cls = getattr(gpt_oss, patch[0])
        saved = (cls, cls.__call__)
        cls.__call__ = patch[1]
    path = tiny_models._write_model(
        root / case, {**families.family_config(fam), **override}, 0, "float32", 512
    )
    model = load(str(path))[0]
    ref = [
        [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n)]
        for p, n in zip(prompts, ns, strict=True)
    ]
    del model
    first = None
    for name, opts, passes in runs:
        try:
            llm = LLM(str(path), max_num_seqs=8, **opts)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"case": case, "run": name, "error": repr(e)}), flush=True)
            continue
        for rep in range(passes):
            got = [r.token_ids for r in llm.generate(prompts, params)]
            first = first or got
            print(
                json.dumps(
                    {
                        "case": case,
                        "run": name,
                        "pass": rep,
                        "env": env,
                        "window_pages": llm.engine.loop.runner.pool.window_pages,
                        "failures": llm.engine.scheduler.stats.step_failures,
                        "vs_mlx_lm": [
                            (i, first_diff(g, r))
                            for i, (g, r) in enumerate(zip(got, ref, strict=True))
                            if g != r
                        ],
                        "vs_first_pass": sum(g != f for g, f in zip(got, first, strict=True)),
                    }
                ),
                flush=True,
            )
        del llm
    if saved is not None:
        saved[0].__call__ = saved[1]
