"""The sides of ``tandem bench offline`` (mlx-lm, Tandem with overlap on and off), each a
loader that returns a run: a callable from one input to a rate (tok/s).

Two ways to take them:
- **interleaved**: every side loaded at once, the runs taken in turn for each input (the
  order rotating from one input to the next), so the machine's drift falls on every side
  alike (this 2-core CPU's speed swings up to 2x from one minute to the next, and ratios
  taken phase by phase swung with it);
- **phase by phase**: one side at a time, freed before the next loads (one copy of the model
  in memory: the large shapes on a GPU).

Each side's first input warms it up (kernel compilation, buffer growth) and is not counted.
Batched inputs are distinct prompt sets, so no run hits Tandem's prefix cache with a
previous run's prompts (mlx-lm has none to hit).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

from tandem.bench.ceiling import free

Run = Callable[[Any], float]
Loader = Callable[[], Run]


def error_text(e: Exception) -> str:
    """What a side that failed records in its row."""
    return f"{type(e).__name__}: {e}"[:300]


def prompt_sets(seed: int, count: int, b: int, length: int, vocab: int) -> list[list[list[int]]]:
    """``count`` sets of ``b`` random prompts of ``length`` tokens, all distinct."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(b)] for _ in range(count)
    ]


def measure(
    loaders: dict[str, Loader],
    inputs: list[Any],
    *,
    interleave: bool,
    optional: frozenset[str] = frozenset(),
    progress: Callable[[dict[str, float], dict[str, str]], None] | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """Median rate of each side over ``inputs[1:]`` (``inputs[0]`` is the warm-up), and the
    errors of the ``optional`` sides that failed (another side's error is raised).
    ``progress`` gets both so far after each phase or round of turns (a crash inside MLX
    later in the measurement then keeps them)."""
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    errors: dict[str, str] = {}

    def attempt(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        if name in errors:
            return None
        try:
            return fn(*args)
        except Exception as e:
            if name not in optional:
                raise
            errors[name] = error_text(e)
        free()  # (outside the handler: its traceback holds the failed side's frames)
        return None

    def load(name: str) -> Run | None:
        run = attempt(name, loaders[name])
        if run is not None and attempt(name, run, inputs[0]) is None:
            run = None  # its warm-up failed
            free()
        return run

    def medians() -> dict[str, float]:
        return {n: statistics.median(r) for n, r in rates.items() if r and n not in errors}

    def report() -> None:
        if progress is not None:
            progress(medians(), dict(errors))

    def take(name: str, run: Run | None, x: Any) -> None:
        rate = attempt(name, run, x) if run is not None else None
        if rate is not None:
            rates[name].append(rate)

    if interleave:
        runs: dict[str, Run | None] = {name: load(name) for name in loaders}
        names = list(runs)
        for i, x in enumerate(inputs[1:]):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                take(name, runs[name], x)
                if name in errors:
                    runs[name] = None  # (a failed side's model goes at once)
            report()
        runs.clear()
        free()
    else:
        for name in loaders:
            one = load(name)
            for x in inputs[1:]:
                take(name, one, x)
            one = None
            free()
            report()
    return medians(), errors
