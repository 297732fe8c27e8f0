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
with each multi-token segment a call of its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import mlx.core as mx

from tandem.engine.plan import RowSampling, Segment, StepPlan
from tandem.runner.paged import PagePool
from tandem.runner.state import StatePool

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner

PROMPT_A = [5, 9, 14, 3, 27, 7, 8, 11, 2]  # 8 prefilled, the 9th decoded
PROMPT_B = [4, 6, 13, 21, 10]
RESUMED_D = [12, 19, 1, 23, 17]  # after PROMPT_A's first page, as long as its rest
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


def _reference(model, tokens: list[int]) -> mx.array:
    """mlx-lm's own caches: prefill ``tokens[:-1]``, then one step on the last token."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([tokens[:-1]]), cache=cache)
    return model(mx.array([tokens[-1:]]), cache=cache)[0, -1]


def _logprobs(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def against_mlx_lm(runner: ModelRunner, model_type: str) -> None:
    """Raise ValueError when the paged path disagrees with mlx-lm's on a short prompt."""
    dtype = runner.specs[0].dtype if runner.specs else mx.float32
    half = HALF_TOLERANCE_OWN_KERNELS if runner.own_recurrence else HALF_TOLERANCE
    tol = TOLERANCE.get(dtype, half)
    try:
        diff, spread = _compare(runner)
        if runner.state_specs and runner.batch_sequences and not diff <= tol * spread:
            raise ValueError(f"log-probabilities differ by up to {diff:.3g}")
    except Exception as e:  # noqa: BLE001 - any failure here means the model is not served
        error = e
        if runner.state_specs and runner.batch_sequences:
            runner.batch_sequences = False  # what if only the (B, n) layout was wrong
            try:
                diff, spread = _compare(runner)
                error = None
                log.warning(
                    "model type %r: multi-token segments run one call each (batched in one "
                    "call they disagreed with mlx-lm: %s)",
                    model_type,
                    e,
                )
            except Exception as again:  # noqa: BLE001
                error = again
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


def _compare(runner: ModelRunner) -> tuple[float, float]:
    """The paged path's log-probabilities against mlx-lm's on the check's prompts: their
    largest difference and the reference's spread."""
    model = runner.model
    vocab = runner.vocab_size
    a = [t % vocab for t in PROMPT_A]
    b = [t % vocab for t in PROMPT_B]
    d = [t % vocab for t in RESUMED_D]
    pages_a, pages_b = (0, 1, 2), (3, 4)
    recurrent = bool(runner.state_specs)
    saved = runner.pool, runner.state_pool
    # The real pool's write path (in place or scatters) on a scratch pool.
    # Sliding-window layers through a window group of their own (other page ids).
    window = bool(runner.max_window)
    runner.pool = PagePool(
        runner.specs,
        9,
        PAGE,
        double_buffer=False,
        inplace=bool(saved[0] and saved[0].inplace),
        window_pages=9 if window else 0,
    )
    w_a, w_b, w_c, w_d = ((6, 5, 4), (3, 2), (6, 1, 0), (6, 7, 8)) if window else ((),) * 4
    # Slots: a, b, the two requests resuming from a's snapshot, the snapshot.
    runner.state_pool = StatePool(runner.state_specs, 5) if recurrent else None
    none = RowSampling((), (), (), ())
    try:
        snap = ((PAGE, 3),) if recurrent else ()
        first = StepPlan(
            1,
            (Segment("a", 0, 8, tuple(a[:8]), pages_a, wpages=w_a, state_slot=0, snapshots=snap),),
            (),
            (),
            none,
        )
        runner.forward(first, mx.array(a[:8], dtype=mx.int32), [7])
        segs = [
            Segment("a", 8, 1, (a[8],), pages_a, wpages=w_a, state_slot=0),
            Segment("b", 0, 5, tuple(b), pages_b, wpages=w_b, state_slot=1),
        ]
        inputs = [a[8], *b]
        if recurrent:  # hits on a's first page and its state there
            c = tuple(a[PAGE:])
            segs.append(
                Segment("c", PAGE, len(c), c, (0, 5, 6), wpages=w_c, state_slot=2, state_src=3)
            )
            segs.append(
                Segment(
                    "d", PAGE, len(d), tuple(d), (0, 7, 8), wpages=w_d, state_slot=4, state_src=3
                )
            )
            inputs += [*c, *d]
        second = StepPlan(2, tuple(segs), (), (), none)
        head = [0, 5, *([5 + len(a) - PAGE, len(inputs) - 1] if recurrent else [])]
        got = runner.forward(second, mx.array(inputs, dtype=mx.int32), head)
        want = [_reference(model, a), _reference(model, b)]
        if recurrent:
            want += [want[0], _reference(model, a[:PAGE] + d)]
        got_lp, want_lp = _logprobs(got), _logprobs(mx.stack(want))
        diff = mx.max(mx.abs(got_lp - want_lp)).item()
        spread = max(mx.std(want_lp).item(), 1e-6)
    finally:
        runner.pool, runner.state_pool = saved
    return diff, spread


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
