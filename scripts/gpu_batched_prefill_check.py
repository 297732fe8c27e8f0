"""New prompts' chunks batched (runner/step_groups.py) against one attention call a prompt,
on the device: a step of decodes, runs of equal prompts, prompts of unequal lengths (padded
groups) and a chunk read from the pool, at the Qwen3-0.6B attention shape (16 query heads,
8 KV heads of 128). Prints the largest difference per dtype (on the CPU both are bit-equal;
on a GPU MLX may pick another SDPA kernel for another length) and, for bf16, the time of
one layer's attention both ways (36 chained calls, median of 20).

    python scripts/gpu_batched_prefill_check.py
"""

import tandem.runner  # noqa: F401, I001  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np

from tandem.bench.paged_attention import timeit
from tandem.engine.plan import Segment
from tandem.runner import step_context
from tandem.runner.attention import gather_attention
from tandem.runner.step_context import StepContext

H, HKV, D, P = 16, 8, 128, 16


def segments(rng: np.random.Generator) -> list[Segment]:
    segs: list[Segment] = []
    page = 1

    def pages(n: int) -> tuple[int, ...]:
        nonlocal page
        k = -(-n // P)
        page += k
        return tuple(range(page - k, page))

    for i in range(8):  # decodes at 300-900 keys
        n = int(rng.integers(300, 900))
        segs.append(Segment(f"d{i}", n - 1, 1, (1,), pages(n), sample_row=i))
    for i in range(4):  # a run of equal prompts
        segs.append(Segment(f"r{i}", 0, 256, (1,) * 256, pages(256)))
    for i in range(6):  # prompts of unequal lengths
        n = int(rng.integers(180, 256))
        segs.append(Segment(f"u{i}", 0, n, (1,) * n, pages(n)))
    segs.append(Segment("tail", 256, 100, (1,) * 100, pages(356)))  # read from the pool
    return segs


def main() -> None:
    rng = np.random.default_rng(0)
    segs = segments(rng)
    t = sum(s.num_tokens for s in segs)
    slots = 4096 * P
    for dtype in (mx.float32, mx.bfloat16):
        pool = mx.array(rng.standard_normal((slots, 2 * HKV, D)).astype(np.float32)).astype(dtype)
        q = mx.array(rng.standard_normal((t, H, 1, D)).astype(np.float32)).astype(dtype)
        kv = mx.array(rng.standard_normal((t, HKV, 1, D)).astype(np.float32)).astype(dtype)
        views = {}
        for batched in (True, False):
            step_context.BATCH_FRESH = batched
            try:
                views[batched] = StepContext(segs, P, kernel=False).view(None, kernel=False)
            finally:
                step_context.BATCH_FRESH = True
        outs = {b: gather_attention(v, q, kv, kv, pool, 0.088) for b, v in views.items()}
        diff = mx.max(mx.abs(outs[True].astype(mx.float32) - outs[False].astype(mx.float32)))
        items = [(c.count, c.pad_rows is not None) for c in views[True].chunks]
        print(f"{dtype}: max |batched - one call each| = {diff.item():.3g}; items {items}")
        if dtype != mx.bfloat16:
            continue
        for batched, view in views.items():

            def chain(view=view, q=q, kv=kv, pool=pool):
                x = q
                for _ in range(36):
                    x = gather_attention(view, x, kv, kv, pool, 0.088)
                return x

            us = timeit(chain) * 1e3 / 36  # (timeit: ms)
            print(f"  {'batched' if batched else 'one call each'}: {us:.1f} us a layer")


if __name__ == "__main__":
    main()
