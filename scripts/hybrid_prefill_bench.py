"""Prefill of equal prompts on a model with recurrent layers: segments of one length sharing
(B, n) model calls (runner/recurrent_step.py) against one call per prompt, in one process,
alternating, medians.

    python scripts/hybrid_prefill_bench.py MODEL_DIR [PROMPTS] [PROMPT_LEN] [REPEATS]
"""

import random
import statistics
import sys
import time

import tandem.runner  # noqa: F401  (preloads BLAS before mlx)
from tandem import LLM, SamplingParams

path = sys.argv[1]
n, length, repeats = (int(a) for a in (sys.argv[2:] + ["16", "256", "2"][len(sys.argv) - 2 :]))
rng = random.Random(0)
times: dict[bool, list[float]] = {True: [], False: []}
for _ in range(repeats):
    for batched in (True, False):
        llm = LLM(path, max_num_seqs=n, max_num_batched_tokens=2048)
        llm.engine.loop.runner.batch_sequences = batched
        vocab = llm.engine.loop.runner.vocab_size
        prompts = [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]
        params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * n
        t = time.perf_counter()
        llm.generate(prompts, params)
        times[batched].append(time.perf_counter() - t)
        del llm
for batched, v in times.items():
    name = "shared calls" if batched else "one call each"
    print(f"{name}: {[round(x, 2) for x in v]} s, median {statistics.median(v):.2f} s")
print(f"ratio {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")
