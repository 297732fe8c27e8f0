"""The overlap loop (DESIGN §2), written as a fold over the steps in flight.

``OverlapLoop.step()`` runs one iteration and returns the outputs it finalized. With
``overlap=False`` the same phases run with at most one step in flight, so both modes share
every line that touches state and must produce identical tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.engine.plan import KVOutOfMemory, StepPlan, StepResult
from tandem.engine.scheduler import Scheduler
from tandem.outputs import EngineOutput

log = logging.getLogger("tandem")


class Runner(Protocol):
    """Launch/finalize split. Handles are opaque; finalize must follow launch order.

    A plan with grammar-constrained rows launched without ``masks`` submits only its forward;
    ``complete`` adds the sampling once the masks are known (before any child launches)."""

    words: int  # int32 words of a grammar bitmask row

    def launch(self, plan: StepPlan, parent: Any | None, masks: Any | None = None) -> Any: ...

    def complete(self, handle: Any, masks: Any) -> None: ...

    def finalize(self, handle: Any) -> StepResult: ...


@dataclass
class InFlightStep:
    plan: StepPlan
    handle: Any


class OverlapLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        overlap: bool = True,
        check_invariants: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.check_invariants = check_invariants
        self.curr: InFlightStep | None = None  # oldest launched, unfinalized step
        self.next: InFlightStep | None = None  # chained on curr's lazy tokens
        self.num_steps = 0
        self.num_chained = 0

    @property
    def inflight(self) -> list[StepPlan]:
        return [s.plan for s in (self.curr, self.next) if s is not None]

    def step(self) -> list[EngineOutput]:
        sched = self.scheduler
        if self.curr is None:
            self.curr = self._launch_fresh()
            if self.curr is None:
                return sched.take_pending_outputs()
        # 1. Chain: submit step N+1 on N's lazy tokens before blocking on N. With constrained
        # rows only its forward goes now; its sampling waits for the masks (step 2).
        if self.overlap and self.next is None:
            plan = sched.chain(self.curr.plan)
            if plan is not None:
                self.next = InFlightStep(plan, self.runner.launch(plan, self.curr.handle))
                self.num_steps += 1
                self.num_chained += 1
        # 2. Finalize curr (the device is busy with next meanwhile), then complete next.
        outputs = self._finalize(self.curr)
        self.curr = None
        if self.next is not None:
            self._complete(self.next)
        # 3. Promote next while the chain holds.
        if self.next is not None:
            nxt, self.next = self.next, None
            if not sched.needs_prefill() and not any(
                sched.running[rid].finished for rid in nxt.plan.request_ids
            ):
                self.curr = nxt
                self._check()
                return outputs
            # 4. The chain breaks: next's tokens are still valid for the live requests.
            outputs += self._finalize(nxt)
        self.curr = self._launch_fresh()
        self._check()
        return outputs

    def drain(self) -> list[EngineOutput]:
        """Finalize whatever is in flight, in launch order (used before shutdown)."""
        outputs: list[EngineOutput] = []
        for s in (self.curr, self.next):
            if s is not None:
                outputs += self._finalize(s)
                if s is self.curr and self.next is not None:
                    self._complete(self.next)
        self.curr = self.next = None
        return outputs

    def _launch_fresh(self) -> InFlightStep | None:
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        self.num_steps += 1
        # Nothing is in flight: every constrained row's previous token is known.
        masks = self.scheduler.grammar_masks(plan, self.runner.words)
        try:
            handle = self.runner.launch(plan, None, masks)
        except KVOutOfMemory as e:
            # Only fresh steps grow the pool. Retract everything, shrink, go on.
            log.warning("%s; retracting all requests, KV budget shrinks", e)
            self.scheduler.recover_from_kv_oom(plan, e.held, e.wanted)
            return None
        return InFlightStep(plan, handle)

    def _complete(self, s: InFlightStep) -> None:
        if s.plan.sampling.constrained:
            self.runner.complete(s.handle, self.scheduler.grammar_masks(s.plan, self.runner.words))

    def _finalize(self, s: InFlightStep) -> list[EngineOutput]:
        result = self.runner.finalize(s.handle)
        return self.scheduler.update(s.plan, result)

    def _check(self) -> None:
        if self.check_invariants:
            self.scheduler.check_invariants(self.inflight)
