"""The plain-loop ceiling of ``tandem bench offline --ceiling``: the fastest decode loop one
can write on mlx-lm's model code, run in the benchmark's process; and ``free``, which gives
back what a benchmark phase held before the next loads its own copy."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path


def free() -> None:
    """Give back what the last phase held before the next loads its own copy: anything left
    in reference cycles (Tandem's engine was, before 2e37714), and the freed buffers MLX
    keeps in its cache (on an 80 GB GPU an 8B shape's copies and KV pools ran out of memory
    without this)."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def plain_loop(
    path: Path, b: int, in_len: int, steps: int, repeats: int, vocab: int, *, prefill: bool
) -> float:
    """The fastest decode loop one can write on mlx-lm's model code, as a ceiling: B equal
    prompts in mlx-lm's own caches, greedy argmax, each step built on the previous step's
    lazy tokens and submitted (``mx.async_eval``) before the host reads that step's tokens;
    no scheduling at all. Output tok/s over ``steps`` steps, timed from the first token
    (``prefill`` False, as the single-stream numbers) or from the start (end to end, as the
    batched ones)."""
    from mlx_lm.utils import load

    model = load(str(path))[0]
    rng = random.Random(b)
    prompt = [[rng.randrange(10, vocab) for _ in range(in_len)] for _ in range(b)]

    def run_once() -> float:
        t = time.perf_counter()
        _, t_first = plain_decode(model, prompt, steps)
        return b * steps / (time.perf_counter() - (t if prefill else t_first))

    try:
        run_once()
        return statistics.median(run_once() for _ in range(repeats))
    finally:
        model = None
        free()


_streams: dict = {}  # the loop's stream per device, made once


def plain_decode(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], float]:
    """The plain loop itself: ``steps`` greedy tokens per prompt (equal lengths), and the
    time its prefill ended."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    # On a stream of its own, as mlx-lm's generate_step and Tandem's runner are. On the
    # default stream the loop read 4-30% below generate_step at one row in every GPU run up
    # to 2026-12-06 (docs/benchmarks.md); the stream is the one difference we know of
    # between the two loops (not yet measured on a GPU this way).
    device = mx.default_device()
    key = str(device)  # (a Device does not hash by value)
    if key not in _streams:
        _streams[key] = mx.new_stream(device)
    with mx.stream(_streams[key]):
        y = mx.argmax(model(mx.array(prompts), cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        t_first = time.perf_counter()
        out = []
        for _ in range(steps):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(nxt)
            out.append(y.tolist())
            y = nxt
    return [list(col) for col in zip(*out, strict=True)], t_first
