"""The plain-loop ceiling of ``tandem bench offline --ceiling``: the fastest decode loop one
can write on mlx-lm's model code, run in the benchmark's process; and ``free``, which gives
back what a benchmark phase held before the next loads its own copy."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free() -> None:
    """Give back what the last phase held before the next loads its own copy: anything left
    in reference cycles (Tandem's engine was, before 2e37714), and the freed buffers MLX
    keeps in its cache (on an 80 GB GPU an 8B shape's copies and KV pools ran out of memory
    without this)."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def side(path: Path, steps: int, *, prefill: bool) -> Callable[[], Callable[[Any], float]]:
    """The fastest decode loop one can write on mlx-lm's model code, as a ceiling: a side of
    ``tandem bench offline`` (bench/sides.py). Its run takes one prompt or a batch of equal
    prompts in mlx-lm's own caches, greedy argmax, each step built on the previous step's lazy
    tokens and submitted (``mx.async_eval``) before the host reads that step's tokens; no
    scheduling at all. Output tok/s over ``steps`` tokens, timed from the first token
    (``prefill`` False, as the single-stream numbers: ``steps - 1`` tokens) or from the start
    (end to end, as the batched ones)."""

    def loader() -> Callable[[Any], float]:
        from mlx_lm.utils import load

        model = load(str(path))[0]

        def run(prompts: list[int] | list[list[int]]) -> float:
            batch = prompts if isinstance(prompts[0], list) else [prompts]
            t = time.perf_counter()
            _, t_first = plain_decode(model, batch, steps)  # type: ignore[arg-type]
            if prefill:
                return len(batch) * steps / (time.perf_counter() - t)
            return len(batch) * (steps - 1) / (time.perf_counter() - t_first)

        return run

    return loader


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
        for i in range(steps):
            nxt = None
            if i + 1 < steps:  # (no forward past the last token: none left in flight)
                nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
                mx.async_eval(nxt)
            out.append(y.tolist())
            y = nxt
    return [list(col) for col in zip(*out, strict=True)], t_first
