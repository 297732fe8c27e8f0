"""A load-time check that Tandem's caches compute what mlx-lm's own caches compute.

Model code is mlx-lm's, unmodified; Tandem only swaps the caches and the attention seam. A
model that uses its cache in a way the probe cannot see (learned positions read from a
scalar offset, KV shared across layers, its own sparse attention) would run, and be wrong.
So before serving, a few tokens go through both paths — mlx-lm's ``make_cache()`` caches and
Tandem's paged step (a prefill chunk, then a decode beside a second request's chunk, in
scratch pools) — and the model is refused if their log-probabilities disagree. A model with
recurrent layers also keeps a snapshot of its state mid-chunk, and two more requests resume
from it on the shared first page, as prefix-cache hits do, in one (2, n) call (the layout of
batched verifies, runner/recurrent_step.py); where only that disagrees, the model is served
with each multi-token segment a call of its own. Where a verify keeps its states per
position (runner/positions.py), requests resumed from them must agree too, or the engine
replays rejected proposals instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import mlx.core as mx

from tandem.engine.plan import RowSampling, Segment, StepPlan
from tandem.runner import positions
from tandem.runner.paged import PagePool
from tandem.runner.state import StatePool

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner

PROMPT_A = [5, 9, 14, 3, 27, 7, 8, 11, 2]  # 8 prefilled, the 9th decoded
PROMPT_B = [4, 6, 13, 21, 10]
RESUMED_D = [12, 19, 1, 23, 17]  # after PROMPT_A's first 8 tokens
FRESH_E = [8, 15, 2, 30, 6]  # as long as PROMPT_B
PROMPT_F = [3, 17, 22, 8, 5, 13, 29, 1, 10]  # beside PROMPT_A in positions.check
PAGE = 4
# Largest |difference| of log-probabilities, over the reference's spread, taken as agreement:
# another summation order stays far below (float32 on the CPU: < 1e-4; on the H200's CUDA
# backend up to 0.006, its float32 matmuls round differently); every wrong path seen was
# above 1 (KV shared across layers: 1.6). In half precision every reordering rounds again:
# a random Qwen3.5-2B shape in bfloat16 on the H200 read 0.21 with the CUDA gated delta
# kernel (float32 arithmetic in a different order than mlx-lm's ops), which gets 0.5.
TOLERANCE = {mx.float32: 0.05}
HALF_TOLERANCE = 0.2
HALF_TOLERANCE_OWN_KERNELS = 0.5

log = logging.getLogger("tandem")


def _reference(model, tokens: list[int], first: int) -> mx.array:
    """mlx-lm's own caches: prefill ``tokens[:first]``, then one call on the rest; the
    logits of its positions, (len(tokens) - first, vocab)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([tokens[:first]]), cache=cache)
    return model(mx.array([tokens[first:]]), cache=cache)[0]


def _logprobs(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def difference(got: mx.array, want: mx.array) -> tuple[float, float]:
    """The largest |difference| of the log-probabilities of two logits arrays, and the
    spread (standard deviation) of ``want``'s."""
    got_lp, want_lp = _logprobs(got), _logprobs(want)
    diff = mx.max(mx.abs(got_lp - want_lp)).item()
    return diff, max(mx.std(want_lp).item(), 1e-6)


@contextmanager
def scratch(runner: ModelRunner, pages: int, slots: int) -> Iterator[None]:
    """The runner's pools replaced, for the block, by a scratch page pool of ``pages`` pages
    of ``PAGE`` positions (the real pool's layout and write path, in place or scatters;
    sliding-window layers in a window group of as many pages) and ``slots`` recurrent-state
    slots."""
    saved = runner.pool, runner.state_pool
    try:
        runner.pool = PagePool(
            runner.specs,
            pages,
            PAGE,
            double_buffer=False,
            inplace=bool(saved[0] and saved[0].inplace),
            window_pages=pages if runner.max_window else 0,
            head_major=bool(saved[0] and saved[0].head_major),
        )
        inplace = bool(saved[1] and saved[1].inplace)  # (the real pool's write path too)
        specs = runner.state_specs
        runner.state_pool = StatePool(specs, slots, inplace) if specs else None
        yield
    finally:
        runner.pool, runner.state_pool = saved


def against_mlx_lm(runner: ModelRunner, model_type: str) -> None:
    """Raise ValueError when the paged path disagrees with mlx-lm's on a short prompt."""
    dtype = runner.specs[0].dtype if runner.specs else mx.float32
    half = HALF_TOLERANCE_OWN_KERNELS if runner.own_recurrence else HALF_TOLERANCE
    tol = TOLERANCE.get(dtype, half)
    # In half precision only each segment's last position, as the tolerance was measured
    # (every further position compared adds its own rounding to the largest difference: a
    # Qwen3.5-2B shape in bfloat16 on the H200, its gated delta kernel off, read 0.21 of the
    # spread over all of them against 0.2).
    every = dtype in TOLERANCE

    def attempt() -> tuple[float, float, Exception | None]:
        try:
            return (*_compare(runner, every), None)
        except Exception as e:  # noqa: BLE001 - any failure here means the model is not served
            return 0.0, 1.0, e

    diff, spread, error = attempt()
    failed = error is not None or not diff <= tol * spread
    if failed and runner.state_specs and runner.batch_sequences:
        # What if only the (B, n) layout was wrong: each multi-token segment alone.
        first = error or f"log-probabilities differ by up to {diff:.3g}"
        runner.batch_sequences = False
        diff, spread, error = attempt()
        if error is None and diff <= tol * spread:
            log.warning(
                "model type %r: multi-token segments run one call each (batched in one "
                "call they disagreed with mlx-lm: %s)",
                model_type,
                first,
            )
    if error is not None:
        raise ValueError(
            f"model type {model_type!r} does not run on Tandem's paged caches: "
            f"{type(error).__name__}: {error}"
        ) from error
    if not diff <= tol * spread:
        raise ValueError(
            f"model type {model_type!r}: Tandem's paged caches disagree with mlx-lm's "
            f"(log-probabilities differ by up to {diff:.3g}, {diff / spread:.2g} of their "
            "spread), so it is not served: its layers use their caches in a way Tandem "
            "does not support yet"
        )
    if runner.state_positions:
        try:
            pair = [[t % runner.vocab_size for t in p] for p in (PROMPT_A, PROMPT_F)]
            diff, spread = positions.check(runner, pair)
            error = None if diff <= tol * spread else f"log-probabilities differ by {diff:.3g}"
        except Exception as e:  # noqa: BLE001 - any failure: verifies replay instead
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            runner.state_positions = False
            log.warning(
                "model type %r: a rejected proposal replays its accepted tokens (resumed "
                "from a verify's per-position states it disagreed with mlx-lm: %s)",
                model_type,
                error,
            )


def _compare(runner: ModelRunner, every_position: bool = True) -> tuple[float, float]:
    """The paged path's log-probabilities against mlx-lm's on the check's prompts: their
    largest difference and the reference's spread.

    Step 1 prefills 8 tokens of request a (with state snapshots at 4 and 8 for a recurrent
    model). Step 2 decodes a's 9th beside a fresh 5-token request b and, for a recurrent
    model, a second fresh one e (b and e share a (2, 5) call) and two prefix hits c and d of
    5 tokens that resume from a's snapshots at different positions, each copying the state
    it reads to a backup as a verify does (c and d share a (2, 5) call); every position of
    c and d is compared (else their last)."""
    model = runner.model
    vocab = runner.vocab_size
    a, b, d, e = ([t % vocab for t in p] for p in (PROMPT_A, PROMPT_B, RESUMED_D, FRESH_E))
    recurrent = bool(runner.state_specs)
    window = bool(runner.max_window)  # (window layers: a window group, other page ids)
    # Full pages and window pages of a, b, c, d, e (hits share a's first pages).
    pages = {"a": (0, 1, 2), "b": (3, 4), "c": (0, 5, 6), "d": (0, 1, 7, 8), "e": (9, 10)}
    wpages = {"a": (6, 5, 4), "b": (3, 2), "c": (6, 1, 0), "d": (6, 5, 7, 8), "e": (9, 10)}
    if not window:
        wpages = dict.fromkeys(wpages, ())
    none = RowSampling((), (), (), ())

    def seg(rid: str, start: int, tokens, slot: int, **kw) -> Segment:
        return Segment(
            rid,
            start,
            len(tokens),
            tuple(tokens),
            pages[rid],
            wpages=wpages[rid],
            state_slot=slot,
            **kw,
        )

    # State slots: a, b, c, d, e; a's snapshots at 4 and 8; c's and d's backups.
    with scratch(runner, 11, 9):
        snaps = ((PAGE, 5), (2 * PAGE, 6)) if recurrent else ()
        first = StepPlan(1, (seg("a", 0, a[:8], 0, snapshots=snaps),), (), (), none)
        runner.forward(first, mx.array(a[:8], dtype=mx.int32), [7])
        segs = [seg("a", 8, a[8:], 0), seg("b", 0, b, 1)]
        want = [_reference(model, a, 8), _reference(model, b, 4)]
        head = [0, 5]
        if recurrent:
            segs += [
                seg("e", 0, e, 4),
                seg("c", PAGE, a[PAGE:], 2, state_src=5, state_backup=7),
                seg("d", 2 * PAGE, d, 3, state_src=6, state_backup=8),
            ]
            hits = [_reference(model, a, PAGE), _reference(model, a[: 2 * PAGE] + d, 2 * PAGE)]
            if every_position:
                head += [10, *range(11, 21)]
            else:
                head += [10, 15, 20]
                hits = [h[-1:] for h in hits]
            want += [_reference(model, e, 4), *hits]
        inputs = [t for s in segs for t in s.token_ids]
        second = StepPlan(2, tuple(segs), (), (), none)
        got = runner.forward(second, mx.array(inputs, dtype=mx.int32), head)
        return difference(got, mx.concatenate(want))


def dense_mask_rank(runner: ModelRunner) -> int:
    """The rank of the padding mask a dense model's attention broadcasts: (T, 1, 1, L)
    as mlx-lm builds it, or (T, 1, 1, 1, L) for models that split query heads into
    (kv heads, repeats) before applying it (gemma2). Tried on 97 decodes (a row count no
    head count equals) of different lengths in a scratch pool."""
    from mlx_lm.models.cache import ArraysCache

    from tandem.runner import kv_owners, layers
    from tandem.runner.paged import cache_class
    from tandem.runner.step_context import StepContext

    pool = PagePool(runner.specs, 1, 4, double_buffer=False)
    n = 97
    segs = tuple(Segment(f"r{i}", i % 3, 1, (1,), (0,)) for i in range(n))
    plan = StepPlan(0, segs, (), (), RowSampling((), (), (), ()))
    inputs = mx.ones((n, 1), dtype=mx.int32)
    error: Exception | None = None
    for rank in (4, 5):
        ctx = StepContext(plan.segments, pool.page_size)
        ctx.mask_rank = rank
        caches, _, _ = layers.build_caches(
            runner.layout,
            lambda i, n, ctx=ctx: cache_class(runner.model_type)(ctx, pool, i),
            lambda j, n: ArraysCache(n.size),
        )
        try:
            with kv_owners.forward():
                mx.eval(runner.model(inputs, cache=caches))
            return rank
        except ValueError as e:
            error = error or e
    raise ValueError(f"the model's attention does not take a padding mask: {error}")
