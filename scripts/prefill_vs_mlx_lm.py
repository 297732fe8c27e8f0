"""Prefill time of B prompts, Tandem's ``LLM.generate`` against mlx-lm's ``batch_generate``,
one output token each, alternating in one process (6 runs each, median of the last 5).

    python scripts/prefill_vs_mlx_lm.py SHAPE B LEN     # e.g. tiny 16 256

SHAPE is a bench shape (tandem/bench/shapes.py), written in float32 to a temp folder; every
run has prompts of its own and Tandem runs without its prefix cache. ``NOATT=1`` replaces
``mx.fast.scaled_dot_product_attention`` by its queries on both sides (what the rest costs).
"""

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tandem.runner  # noqa: F401  (preloads BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm import batch_generate, load  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench.shapes import make_model  # noqa: E402

shape, b, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path = make_model(shape, "float32", Path(tempfile.mkdtemp()))
model, tokenizer = load(str(path))
llm = LLM(str(path), max_num_seqs=b, prefix_cache=False)
if os.environ.get("NOATT"):
    mx.fast.scaled_dot_product_attention = lambda q, k, v, **kw: q
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
times: dict[str, list[float]] = {"tandem": [], "mlx-lm": []}
for _ in range(6):
    for side in times:
        prompts = [[rng.randrange(5, 500) for _ in range(n)] for _ in range(b)]
        t = time.perf_counter()
        if side == "tandem":
            llm.generate(prompts, params)
        else:
            batch_generate(model, tokenizer, prompts, max_tokens=1, verbose=False)
        times[side].append(time.perf_counter() - t)
for side, ts in times.items():
    print(f"{side}: median {statistics.median(ts[1:]) * 1e3:.1f} ms", [round(x * 1e3) for x in ts])
