"""Single stream on the GPU three ways, one process, in turn: mlx-lm's generate_step, Tandem's
LLM.generate (one request) and LLM.stream (what `tandem bench offline` times), decode tok/s
from the first token. Shows what the streaming iterator costs per token.

    python scripts/gpu_stream_vs_generate.py SHAPE [TOKENS]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import tandem.runner  # noqa: F401

# isort: split
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from tandem import LLM, SamplingParams
from tandem.bench.offline import make_model

shape = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
dtype = "bfloat16" if mx.default_device() != mx.cpu else "float32"
with tempfile.TemporaryDirectory() as tmp:
    path = make_model(shape, dtype, Path(tmp))
    prompt = [10 + i % 300 for i in range(32)]
    model = load(str(path))[0]
    llm = LLM(str(path), max_num_seqs=8)
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def mlx_lm() -> float:
        t0 = 0.0
        for i, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=n)):
            if i == 0:
                t0 = time.perf_counter()
        return (n - 1) / (time.perf_counter() - t0)

    def stream() -> float:
        t0 = 0.0
        for i, _ in enumerate(llm.stream(prompt, sp)):
            if i == 0:
                t0 = time.perf_counter()
        return (n - 1) / (time.perf_counter() - t0)

    def generate() -> float:
        # (prefill included: a 32-token prompt's is one step)
        t = time.perf_counter()
        out = llm.generate([prompt], sp)
        assert len(out[0].token_ids) == n
        return n / (time.perf_counter() - t)

    runs: dict[str, list[float]] = {"mlx_lm": [], "tandem_stream": [], "tandem_generate": []}
    fns = {"mlx_lm": mlx_lm, "tandem_stream": stream, "tandem_generate": generate}
    for r in range(4):
        for k, f in fns.items():
            v = f()
            if r:
                runs[k].append(v)
    print(shape, {k: round(statistics.median(v), 1) for k, v in runs.items()})
