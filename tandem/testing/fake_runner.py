"""A model-free runner whose "KV" is the token ids themselves.

Each row keeps the token written at each position (by prefill chunks, decode inputs and prefix
copies), and a step's output token is a pure function of the request's seed and the row's
whole history ``[0, position]``. So any KV bookkeeping error (a wrong copy, a stale cached row,
a chained step accounted at the wrong position, a hole overwriting cached KV) changes the
tokens, which tests compare against ``fake_token`` run over the true sequence. It also honours
the launch/finalize contract (launch order, chained steps reading the parent's tokens, rows
beyond ``kv_rows`` lost when the buffers are reallocated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.engine.grammar import words_for
from tandem.engine.plan import StepPlan, StepResult

VOCAB = 1000


def fake_token(seed: int, history: Sequence[int]) -> int:
    """The token a request with ``seed`` samples after ``history`` (prompt and outputs)."""
    h = hash(tuple(history)) & 0xFFFFFFFF
    return (seed * 7919 + len(history) * 104729 + h * 31 + 17) % VOCAB


@dataclass
class FakeHandle:
    plan: StepPlan
    tokens: tuple[int, ...] | None
    finalized: bool = False
    raw: tuple[int, ...] = ()  # tokens before grammar masks


def masked_token(raw: int, mask_row: np.ndarray) -> int:
    """The allowed token a constrained row takes: deterministic in ``raw``."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits)
    assert allowed.size, "a grammar mask allows nothing"
    return int(allowed[raw % allowed.size])


@dataclass
class FakeRunner:
    """Records every launch; checks finalize order and that chains follow their parent."""

    launched: list[StepPlan] = field(default_factory=list)
    kv: dict[int, list[int | None]] = field(default_factory=dict)
    capacity: int = 0
    copied_tokens: int = 0
    _unfinalized: list[FakeHandle] = field(default_factory=list)
    words: int = words_for(VOCAB)
    completed_late: int = 0  # chained steps whose sampling waited for grammar masks

    def launch(
        self, plan: StepPlan, parent: FakeHandle | None, masks: np.ndarray | None = None
    ) -> FakeHandle:
        if plan.chained:
            assert parent is not None and parent.plan.row_request_ids == plan.row_request_ids
            assert parent.tokens is not None, "chained on a step still waiting for masks"
            assert plan.input_tokens is None
            inputs = parent.tokens
        else:
            assert parent is None and plan.input_tokens is not None
            # No fresh step may launch while another is unfinalized (fresh steps follow
            # a chain break, which finalizes everything first).
            assert not self._unfinalized, "fresh launch with a step in flight"
            inputs = plan.input_tokens
        assert len(self._unfinalized) < 2, "more than two steps in flight"
        self.launched.append(plan)
        self._grow(plan)
        for c in plan.copies:
            assert c.src < max(plan.kv_rows, plan.num_rows), "copy from a row the plan drops"
            src = self.kv[c.src][: c.length]
            assert len(src) == c.length and None not in src, "copy of unwritten KV"
            self._row(c.dst)[: c.length] = src
            self.copied_tokens += c.length
        for chunk in plan.chunks:
            row = self._row(chunk.row)
            assert chunk.start + len(chunk.token_ids) <= plan.capacity
            assert None not in row[: chunk.start], "chunk attends to unwritten KV"
            row[chunk.start : chunk.start + len(chunk.token_ids)] = list(chunk.token_ids)
        tokens = []
        for i, (rid, pos, tok) in enumerate(
            zip(plan.row_request_ids, plan.positions, inputs, strict=True)
        ):
            assert pos < plan.capacity, "write past the row capacity"
            row = self._row(i)
            row[pos] = tok
            history = row[: pos + 1]
            if rid is not None:
                assert None not in history, f"{rid} attends to unwritten KV"
            tokens.append(fake_token(plan.sampling.seed[i], [t or 0 for t in history]))
        handle = FakeHandle(plan, None, raw=tuple(tokens))
        self._unfinalized.append(handle)
        if plan.sampling.constrained and masks is None:
            assert plan.chained, "a fresh step knows its masks"
            return handle
        self._sample(handle, masks)
        return handle

    def complete(self, handle: FakeHandle, masks: np.ndarray) -> None:
        assert handle.tokens is None and handle in self._unfinalized
        assert self._unfinalized[0] is handle, "masks must wait for the parent's finalize"
        self.completed_late += 1
        self._sample(handle, masks)

    def _sample(self, handle: FakeHandle, masks: np.ndarray | None) -> None:
        tokens = list(handle.raw)
        rows = handle.plan.sampling.constrained
        assert (masks is None) == (not rows)
        for i, row in enumerate(rows):
            assert masks is not None
            tokens[row] = masked_token(tokens[row], masks[i])
        handle.tokens = tuple(tokens)

    def finalize(self, handle: FakeHandle) -> StepResult:
        assert handle.tokens is not None, "finalized before its masks were given"
        assert self._unfinalized and self._unfinalized[0] is handle, "finalize out of order"
        self._unfinalized.pop(0)
        handle.finalized = True
        return StepResult(handle.plan.step_id, handle.tokens)

    def _grow(self, plan: StepPlan) -> None:
        """Like the real pool: growing the capacity reallocates, keeping only needed rows."""
        if plan.capacity > self.capacity:
            keep = max(
                [plan.num_rows, plan.kv_rows]
                + [c.row + 1 for c in plan.chunks]
                + [c.dst + 1 for c in plan.copies]
            )
            self.kv = {r: v for r, v in self.kv.items() if r < keep}
            self.capacity = plan.capacity

    def _row(self, row: int) -> list[int | None]:
        buf = self.kv.setdefault(row, [])
        if len(buf) < self.capacity:
            buf.extend([None] * (self.capacity - len(buf)))
        return buf
