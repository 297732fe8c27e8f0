"""The recurrent state after each position of a speculative verify, so that a rejected
proposal needs no replay.

A verify of ``n`` tokens advances a recurrent layer's state over all of them; when only the
first ``e`` are accepted, the request must go on from the state after ``e``. Without more, the
engine keeps the state before the verify and replays the accepted tokens from it (a call and
a step of their own, engine/results.py). Where the layers let the runner see each position's
state, the verify instead keeps the states after its positions ``0 .. n - 2`` under ids of
their own (``Segment.state_positions``; runner/state.py holds them outside the pool), and
the request resumes from the one it needs.

That is so for layers as mlx-lm writes Gated DeltaNet (Qwen3-Next, Qwen3.5, Kimi Linear,
OLMo Hybrid, Ling (bailing_moe_v3)), Mamba-2 (Mamba-2, Nemotron-H, Falcon-H1, Granite 4.0,
PLaMo 2) and short convolutions alone (LFM2): short convolutions (one, or q, k and v) over
``concat(conv_state, x)``, whose state after position ``j`` is that input's ``keep`` rows
after row ``j``, then (but in LFM2) a gated delta recurrence (every position's state from
one CUDA launch, or position by position; runner/gated_delta.py) or Mamba-2's SSD (each
position's state in closed form, ``ssm_update`` here). While a call captures, each
layer's ``StepState`` is the current target (set when the layer reads its cache, as it does
first) of its convolution's input and its recurrence's states. ``install`` marks the
convolutions; the load check (``check``, from runner/verify.py) proves the states resume as
mlx-lm runs, or the engine replays instead.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import ssm as mlx_ssm

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner


class Capture:
    """What one recurrent layer's call left to read per position: its convolutions' inputs
    (B, keep + T, C), in the order they ran (that of the cache entries they keep: q, k, v in
    Kimi Linear), and its recurrence's state after each position (each (B, ...), arrays of
    their own, so holding one does not keep the others)."""

    def __init__(self) -> None:
        self.convs: list[mx.array] = []
        self.states: list[mx.array] | None = None
        self._read = 0  # convolution entries given so far

    def per_position(self, new: mx.array, m: int) -> list[mx.array]:
        """The next cache entry (in entry order) whose value after the call is ``new``
        (B, ...), after each of the call's first ``m`` positions."""
        s = self.states
        if s is not None and len(s) >= m and new.shape == s[0].shape:
            return s[:m]
        if self._read < len(self.convs):
            c = self.convs[self._read]
            keep = new.shape[1] if new.ndim == 3 else 0
            if keep and new.shape[::2] == c.shape[::2] and c.shape[1] - keep >= m:
                self._read += 1
                return [c[:, j + 1 : j + 1 + keep] for j in range(m)]
        raise RuntimeError(
            f"no per-position value for a recurrent cache entry of shape {new.shape}"
        )


_target: list[Capture | None] = [None]


def aim(capture: Capture | None) -> None:
    """The layer now running captures into ``capture`` (None: nothing captures)."""
    _target[0] = capture


def current() -> Capture | None:
    return _target[0]


def ssm_update(
    hidden_states: mx.array,
    A_log: mx.array,  # noqa: N803 - mlx-lm's names
    B: mx.array,  # noqa: N803
    C: mx.array,  # noqa: N803
    D: mx.array,  # noqa: N803
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    time_step_limit: tuple[float, float] = (0.001, 100.0),
    mask: mx.array | None = None,
    lengths: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``ssm_update`` (Mamba-2 layers), also giving the current capture the state
    after each position."""
    y, new = mlx_ssm.ssm_update(
        hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths
    )
    capture = _target[0]
    if capture is not None and mask is None and lengths is None:
        capture.states = _ssd_states(hidden_states, A_log, B, dt, dt_bias, state, time_step_limit)
    return y, new


def _ssd_states(x, A_log, B, dt, dt_bias, state, limit) -> list[mx.array]:  # noqa: N803
    """The SSD recurrence's state after each position (as mlx-lm's ``ssm_attn`` computes the
    last): state_j = sum_{t <= j} decay[j, t] dt_t x_t B_t^T + exp(sum_{k <= j} dtA_k) state,
    each (b, h, dh, d)."""
    b, n, h, dh = x.shape
    g = B.shape[2]
    dt = mlx_ssm.compute_dt(dt, dt_bias, limit)  # (b, n, h)
    dtA = dt * (-mx.exp(A_log).astype(dt.dtype)).reshape(1, 1, -1)  # noqa: N806
    dtx = (dt.reshape(b, n, h, 1) * x).swapaxes(1, 2)  # (b, h, n, dh)
    # (b, h, n (j), n (t)); causal (mlx-lm's segsum leaves exp(0) above the diagonal)
    decay = mx.tril(mx.exp(mlx_ssm.segsum(dtA.swapaxes(1, 2))))
    bh = mx.repeat(B, h // g, axis=2).swapaxes(1, 2)  # (b, h, n, d)
    carry = mx.exp(mx.cumsum(dtA, axis=1))  # (b, n, h)
    states = []
    for j in range(n):
        # (b, h, dh, t) @ (b, h, t, d)
        s = (decay[:, :, j, :, None] * dtx).swapaxes(-1, -2) @ bh
        if state is not None:
            s = s + carry[:, j, :, None, None] * state
        states.append(s)
    return states


SEAMS = ("gated_delta_update", "ssm_update")  # the recurrences a capture sees

_classes: dict[type, type] = {}


def _capturing(cls: type) -> type:
    """``cls`` (a convolution module) whose call gives its input to the current capture."""
    if getattr(cls, "_tandem_capturing", False):
        return cls  # (marked already)
    if cls not in _classes:

        def __call__(self, x: mx.array) -> mx.array:  # noqa: N807 - the module's call
            capture = _target[0]
            if capture is not None:
                capture.convs.append(x)
            return cls.__call__(self, x)

        _classes[cls] = type(
            f"Capturing{cls.__name__}", (cls,), {"__call__": __call__, "_tandem_capturing": True}
        )
    return _classes[cls]


def _layers(model: nn.Module) -> list[list[nn.Conv1d]]:
    """The short convolutions of each recurrent layer whose states a call can capture: a
    recurrence (``A_log``, ``dt_bias``) in a module that calls one of the ``SEAMS``, with the
    convolutions inside it (one, or q, k and v); or a ``conv`` or ``conv1d`` alone (a
    short-convolution layer: LFM2) outside any recurrence."""
    layers: list[list[nn.Conv1d]] = []
    taken: set[int] = set()
    for m in model.modules():
        if not (hasattr(m, "A_log") and hasattr(m, "dt_bias")):
            continue
        module = sys.modules.get(type(m).__module__)
        convs = [c for _, c in m.named_modules() if isinstance(c, nn.Conv1d)]
        taken |= {id(c) for c in convs}
        if any(hasattr(module, seam) for seam in SEAMS):
            layers.append(convs)
    for m in model.modules():
        if hasattr(m, "A_log"):
            continue
        convs = [getattr(m, n, None) for n in ("conv1d", "conv")]
        conv = next((c for c in convs if isinstance(c, nn.Conv1d)), None)
        if conv is not None and id(conv) not in taken:
            layers.append([conv])
            taken.add(id(conv))
    return layers


def install(model: nn.Module, recurrent_layers: int) -> bool:
    """Mark the convolutions of the model's Gated DeltaNet, Mamba-2 and short-convolution
    layers (``_layers``; ``ssm_update`` captures through the one here); True when there is
    one such layer per recurrent layer (a layer with any other state fails the load check's
    resume, and the engine replays).
    ``TANDEM_STATE_POSITIONS=0`` turns them off (rejected proposals replay, as for other
    recurrent layers)."""
    if os.environ.get("TANDEM_STATE_POSITIONS") == "0":
        return False
    layers = _layers(model)
    if not layers or len(layers) != recurrent_layers:
        return False
    for convs in layers:
        for conv in convs:
            conv.__class__ = _capturing(type(conv))
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if getattr(module, "ssm_update", None) is mlx_ssm.ssm_update:
            module.__dict__["ssm_update"] = ssm_update
    return True


def check(runner: ModelRunner, prompts: list[list[int]]) -> tuple[float, float]:
    """Resumed from the states a verify kept at its positions, against mlx-lm: two requests
    of 9 tokens (``prompts``) prefill 4 tokens and verify the other 5 in one (2, 5) batch,
    cut after its first position where each keeps a snapshot (as a verify beside the prefix
    cache's checkpoint runs: a piece of one token, then one of four), keeping the states
    after positions 4 .. 7 under ids past the scratch pool's 4 slots (pages of 4 positions);
    then one decodes its
    6th token from the state after its 5th while the other runs its 8th and 9th from the
    state after its 7th as one segment. The largest difference of log-probabilities and the
    reference's spread."""
    from tandem.engine.plan import RowSampling, Segment, StepPlan
    from tandem.runner.verify import _reference, difference, scratch

    model = runner.model
    tokens = dict(zip("ab", prompts, strict=True))
    window = bool(runner.max_window)
    none = RowSampling((), (), (), ())
    pages = {"a": (0, 1, 2), "b": (3, 4, 5)}

    def seg(rid: str, start: int, n: int, **kw) -> Segment:
        ids = tuple(tokens[rid][start : start + n])
        wp = pages[rid] if window else ()
        return Segment(rid, start, n, ids, pages[rid], wpages=wp, **kw)

    def step(i: int, segs: list[Segment], head: list[int]) -> mx.array:
        inputs = mx.array([t for s in segs for t in s.token_ids], dtype=mx.int32)
        return runner.forward(StepPlan(i, tuple(segs), (), (), none), inputs, head)

    with scratch(runner, 6, 4):
        step(1, [seg("a", 0, 4, state_slot=0), seg("b", 0, 4, state_slot=1)], [3, 7])
        verify = [
            seg("a", 4, 5, state_slot=0, state_positions=(4, 5, 6, 7), snapshots=((5, 2),)),
            seg("b", 4, 5, state_slot=1, state_positions=(8, 9, 10, 11), snapshots=((5, 3),)),
        ]
        step(2, verify, [4, 9])
        resumed = [
            seg("a", 5, 1, state_slot=0, state_src=4),
            seg("b", 7, 2, state_slot=1, state_src=10),
        ]
        got = step(3, resumed, [0, 1, 2])
        a, b = prompts
        want = mx.concatenate([_reference(model, a[:6], 5), _reference(model, b, 7)])
        return difference(got, want)
