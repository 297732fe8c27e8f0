"""A model-free runner: each token is a pure function of (request seed, position).

It honours the launch/finalize contract (launch order, chained steps reading the parent's
tokens) so tests can drive the real scheduler and overlap loop without MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.plan import StepPlan, StepResult

VOCAB = 1000


def fake_token(seed: int, position: int) -> int:
    return (seed * 7919 + position * 104729 + 17) % VOCAB


@dataclass
class FakeHandle:
    plan: StepPlan
    tokens: tuple[int, ...]
    finalized: bool = False


@dataclass
class FakeRunner:
    """Records every launch; checks finalize order and that chains follow their parent."""

    launched: list[StepPlan] = field(default_factory=list)
    _unfinalized: list[FakeHandle] = field(default_factory=list)

    def launch(self, plan: StepPlan, parent: FakeHandle | None) -> FakeHandle:
        if plan.chained:
            assert parent is not None and parent.plan.row_request_ids == plan.row_request_ids
            assert plan.input_tokens is None
        else:
            assert parent is None and plan.input_tokens is not None
            # No fresh step may launch while another is unfinalized (fresh steps follow
            # a chain break, which finalizes everything first).
            assert not self._unfinalized, "fresh launch with a step in flight"
        assert len(self._unfinalized) < 2, "more than two steps in flight"
        self.launched.append(plan)
        tokens = tuple(
            fake_token(seed, pos)
            for seed, pos in zip(plan.sampling.seed, plan.positions, strict=True)
        )
        handle = FakeHandle(plan, tokens)
        self._unfinalized.append(handle)
        return handle

    def finalize(self, handle: FakeHandle) -> StepResult:
        assert self._unfinalized and self._unfinalized[0] is handle, "finalize out of order"
        self._unfinalized.pop(0)
        handle.finalized = True
        return StepResult(handle.plan.step_id, handle.tokens)
