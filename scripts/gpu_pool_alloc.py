"""Does a large device allocation alone slow a single stream (GPU probe)?

On the H200 (2026-12-06) Tandem's single stream ran 15-24% slower with its default KV pool
(half the free memory: 71 GB on the 0.6B shape) than with an 8,192-token one, and the host's
per-step work on the CPU does not depend on the pool's size. This keeps the pool at 8,192
tokens and holds an unrelated allocation of GB gibibytes beside it, as one block and as
1 GiB blocks, in turn with none: if the rate drops with the allocation alone, the cost is
the device's (address translation, the allocator), not anything Tandem does with the pool.

    python scripts/gpu_pool_alloc.py MODEL_DIR GB

Prints the median decode tok/s of each case and every run.
"""

from __future__ import annotations

import statistics
import sys
import time

import tandem.runner  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx

from tandem import LLM, SamplingParams

N = 256
PROMPT = [11 + i % 50 for i in range(32)]


def main() -> None:
    path, gb = sys.argv[1], float(sys.argv[2])
    llm = LLM(path, max_num_seqs=8, kv_budget_tokens=8192)
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)

    def rate() -> float:
        t0 = 0.0
        for i, _ in enumerate(llm.stream(PROMPT, sp)):
            if i == 0:
                t0 = time.perf_counter()
        return (N - 1) / (time.perf_counter() - t0)

    rate()
    res: dict[str, list[float]] = {"none": [], "one_block": [], "1gib_blocks": []}
    for _ in range(3):
        res["none"].append(rate())
        # one buffer, two dimensions (MLX takes each dimension as a 32-bit int)
        big = mx.zeros((int(gb * 2**10), 2**19), mx.bfloat16)
        mx.eval(big)
        rate()
        res["one_block"].append(rate())
        del big
        mx.clear_cache()
        blocks = [mx.zeros((2**29,), mx.bfloat16) for _ in range(int(gb))]
        mx.eval(blocks)
        rate()
        res["1gib_blocks"].append(rate())
        del blocks
        mx.clear_cache()
    print({k: round(statistics.median(v), 1) for k, v in res.items()})
    print({k: [round(x) for x in v] for k, v in res.items()})


if __name__ == "__main__":
    main()
