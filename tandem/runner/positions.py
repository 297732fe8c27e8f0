"""The recurrent state after each position of a speculative verify, so that a rejected
proposal needs no replay.

A verify of ``n`` tokens advances a recurrent layer's state over all of them; when only the
first ``e`` are accepted, the request must go on from the state after ``e``. Without more, the
engine keeps the state before the verify and replays the accepted tokens from it (a call and
a step of their own, engine/results.py). Where the layers let the runner see each position's
state, the verify instead copies the states after its positions ``0 .. n - 2`` to snapshot
slots, and the request resumes from the one it needs (``Segment.state_positions``).

That is so for Gated DeltaNet layers as mlx-lm writes them (Qwen3-Next, Qwen3.5 and their
MoE variants): a short convolution over ``concat(conv_state, x)``, whose state after
position ``j`` is that input's ``keep`` rows after row ``j``, and the gated delta recurrence,
which runs position by position and is asked for each state (runner/gated_delta.py). While
a call captures, each layer's ``StepState`` is the current target (set when the layer reads
its cache, as it does first) of its convolution's input and its recurrence's states.
``install`` marks the convolutions; the load check (runner/verify.py) proves the states
resume exactly as mlx-lm runs, or the engine replays instead.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner


class Capture:
    """What one recurrent layer's call left to read per position: its convolution's input
    (B, keep + T, C) and its recurrence's states (B, T, ...)."""

    def __init__(self) -> None:
        self.conv: mx.array | None = None
        self.states: mx.array | None = None

    def per_position(self, new: mx.array, m: int) -> mx.array:
        """The entry whose value after the call is ``new`` (B, ...), after each of the
        call's first ``m`` positions: (B, m, ...)."""
        s, c = self.states, self.conv
        if s is not None and new.shape == (s.shape[0], *s.shape[2:]) and s.shape[1] >= m:
            return s[:, :m]
        if c is not None and new.ndim == 3 and new.shape[::2] == c.shape[::2]:
            keep = new.shape[1]
            if c.shape[1] - keep >= m:
                rows = mx.arange(1, m + 1)[:, None] + mx.arange(keep)[None, :]
                return c[:, rows]
        raise RuntimeError(
            f"no per-position value for a recurrent cache entry of shape {new.shape}"
        )


_target: list[Capture | None] = [None]


def aim(capture: Capture | None) -> None:
    """The layer now running captures into ``capture`` (None: nothing captures)."""
    _target[0] = capture


def current() -> Capture | None:
    return _target[0]


_classes: dict[type, type] = {}


def _capturing(cls: type) -> type:
    """``cls`` (a convolution module) whose call gives its input to the current capture."""
    if cls not in _classes:

        def __call__(self, x: mx.array) -> mx.array:  # noqa: N807 - the module's call
            capture = _target[0]
            if capture is not None:
                capture.conv = x
            return cls.__call__(self, x)

        _classes[cls] = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
    return _classes[cls]


def install(model: nn.Module, recurrent_layers: int) -> bool:
    """Mark the convolutions of the model's Gated DeltaNet layers (a ``conv1d`` beside
    ``A_log`` and ``dt_bias``, in a module that calls ``gated_delta_update``); True when
    there is one such layer per recurrent layer. ``TANDEM_STATE_POSITIONS=0`` turns them
    off (rejected proposals replay, as for other recurrent layers)."""
    if os.environ.get("TANDEM_STATE_POSITIONS") == "0":
        return False
    found = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "conv1d", None), nn.Conv1d)
        and hasattr(m, "A_log")
        and hasattr(m, "dt_bias")
        and hasattr(sys.modules.get(type(m).__module__), "gated_delta_update")
    ]
    if not found or len(found) != recurrent_layers:
        return False
    for m in found:
        conv = m.conv1d
        conv.__class__ = _capturing(type(conv))
    return True


def check(runner: ModelRunner, prompt: list[int], page: int) -> tuple[float, float]:
    """Resumed from the states a verify kept at its positions, against mlx-lm: two requests
    of ``prompt`` (9 tokens) prefill 4 tokens, verify the other 5 in one (2, 5) call keeping
    the states after positions 4 .. 7, then decode the 7th and the 9th token from the states
    after the 6th and the 8th. The largest difference of log-probabilities and their spread."""
    from tandem.engine.plan import RowSampling, Segment, StepPlan
    from tandem.runner.paged import PagePool
    from tandem.runner.state import StatePool
    from tandem.runner.verify import _logprobs, _reference

    model, a = runner.model, prompt
    saved = runner.pool, runner.state_pool
    window = bool(runner.max_window)
    runner.pool = PagePool(
        runner.specs,
        6,
        page,
        double_buffer=False,
        inplace=bool(saved[0] and saved[0].inplace),
        window_pages=6 if window else 0,
    )
    runner.state_pool = StatePool(runner.state_specs, 10)
    none = RowSampling((), (), (), ())
    pages = {"a": (0, 1, 2), "b": (3, 4, 5)}

    def seg(rid: str, start: int, n: int, **kw) -> Segment:
        tokens = tuple(a[start : start + n])
        wp = pages[rid] if window else ()
        return Segment(rid, start, n, tokens, pages[rid], wpages=wp, **kw)

    def step(i: int, segs: list[Segment], head: list[int]) -> mx.array:
        inputs = mx.array([t for s in segs for t in s.token_ids], dtype=mx.int32)
        return runner.forward(StepPlan(i, tuple(segs), (), (), none), inputs, head)

    try:
        step(1, [seg("a", 0, 4, state_slot=0), seg("b", 0, 4, state_slot=1)], [3, 7])
        verify = [
            seg("a", 4, 5, state_slot=0, state_positions=(2, 3, 4, 5)),
            seg("b", 4, 5, state_slot=1, state_positions=(6, 7, 8, 9)),
        ]
        step(2, verify, [4, 9])
        resumed = [
            seg("a", 6, 1, state_slot=0, state_src=3),
            seg("b", 8, 1, state_slot=1, state_src=9),
        ]
        got = step(3, resumed, [0, 1])
        want = mx.concatenate([_reference(model, a[:7], 6), _reference(model, a, 8)])
        got_lp, want_lp = _logprobs(got), _logprobs(want)
        diff = mx.max(mx.abs(got_lp - want_lp)).item()
        spread = max(mx.std(want_lp).item(), 1e-6)
    finally:
        runner.pool, runner.state_pool = saved
    return diff, spread
