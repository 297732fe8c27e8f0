"""The overlap loop (DESIGN §2), written as a fold over the steps in flight.

Every step is built while the one before it is still on the device: its decode inputs are that
step's lazy tokens, its prefill chunks come from the host. ``OverlapLoop.step()`` launches the
next step, then finalizes the current one. With ``overlap=False`` the same phases run with at
most one step in flight, so both modes share every line that touches state and must produce
identical tokens.

Where the chain breaks — the one place these rules live:
- ``Scheduler.schedule(parent)`` returns None: nothing is left to run beyond the parent, or the
  running decodes need pages only a retraction can free (retracting needs nothing in flight).
- A grammar-constrained row's mask needs its previous token on the host: the step's forward
  still launches chained; only its small sampling graph waits (``Runner.complete``) until the
  parent is finalized.
There is no host-side logits processor, and pages are freed only after every step that lists
them is finalized (late release), so no slot is reused under an in-flight step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.engine.plan import StepPlan, StepResult, is_oom
from tandem.engine.scheduler import Scheduler
from tandem.outputs import EngineOutput

log = logging.getLogger("tandem")


class Runner(Protocol):
    """Launch/finalize split. Handles are opaque; finalize must follow launch order.

    A plan with grammar-constrained rows launched without ``masks`` submits only its forward;
    ``complete`` adds the sampling once the masks are known (before any child launches).
    ``reset`` drops every in-flight step and recreates the KV pool (after a failure)."""

    words: int  # int32 words of a grammar bitmask row

    @property
    def shapes(self) -> int:
        """Compiled step shapes met so far: a launch that meets a new one traces it."""
        ...

    def launch(self, plan: StepPlan, parent: Any | None, masks: Any | None = None) -> Any: ...

    def complete(self, handle: Any, masks: Any) -> None: ...

    def finalize(self, handle: Any) -> StepResult: ...

    def reset(self) -> None: ...


@dataclass
class InFlightStep:
    plan: StepPlan
    handle: Any
    launched: float = 0.0  # the clock when its launch began
    # Its time is not a steady step's: its launch, or a child's launched before it
    # finalized, met a new shape (traced: the model's Python, then MLX compiling kernels).
    fresh: bool = False


class OverlapLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        overlap: bool = True,
        check_invariants: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.check_invariants = check_invariants
        self.curr: InFlightStep | None = None  # the oldest launched, unfinalized step
        self.num_steps = 0
        self.num_chained = 0
        self.num_fresh = 0  # finalized steps whose time held a new shape's trace
        # Step times for the scheduler (engine/spec_gain.py): a step's run from its launch,
        # or the previous finalize if later, to its own finalize.
        self.clock = clock
        self._last_end = 0.0

    @property
    def inflight(self) -> list[StepPlan]:
        return [self.curr.plan] if self.curr is not None else []

    def step(self) -> list[EngineOutput]:
        self._out: list[EngineOutput] = []
        failure: Exception | None = None
        try:
            self._step()
        except Exception as e:  # noqa: BLE001 - any failure inside a step is contained
            failure = e
        if failure is not None:
            # Outside the except block, so the failed graph's arrays (held by its frames)
            # can be freed before the runner allocates its pool again.
            self._recover(failure)
        return self._out + self.scheduler.take_pending_outputs()

    def _step(self) -> None:
        if self.curr is None:
            self.curr = self._launch(None)
            if self.curr is None:
                return
        # 1. Submit step N+1 on N's lazy tokens before blocking on N. With constrained rows
        # only its forward goes now; its sampling waits for the masks (step 2).
        nxt = self._launch(self.curr) if self.overlap else None
        if nxt is not None and nxt.fresh:
            self.curr.fresh = True  # (N's interval holds N+1's tracing)
        # 2. Finalize N (the device is busy with N+1 meanwhile), then complete N+1.
        self._finalize(self.curr)
        self.curr = nxt
        if nxt is not None:
            self._complete(nxt)
        else:
            # 3. The chain broke (or overlap is off): a fresh step with nothing in flight.
            self.curr = self._launch(None)
        self._check()

    def drain(self) -> list[EngineOutput]:
        """Finalize whatever is in flight (used before shutdown or a pause)."""
        self._out = []
        if self.curr is not None:
            try:
                self._finalize(self.curr)
            except Exception as e:  # noqa: BLE001
                self._recover(e)
            self.curr = None
        return self._out + self.scheduler.take_pending_outputs()

    def _launch(self, parent: InFlightStep | None) -> InFlightStep | None:
        launched = self.clock()
        plan = self.scheduler.schedule(parent.plan if parent is not None else None)
        if plan is None:
            return None
        self.num_steps += 1
        self.num_chained += parent is not None
        self._failing = plan
        # A fresh step knows every constrained row's previous token; a chained one waits.
        masks = None if parent else self.scheduler.grammar_masks(plan, self.runner.words)
        shapes = self.runner.shapes
        handle = self.runner.launch(plan, parent.handle if parent else None, masks)
        self._failing = None
        return InFlightStep(plan, handle, launched, self.runner.shapes != shapes)

    def _complete(self, s: InFlightStep) -> None:
        if s.plan.sampling.constrained:
            self._failing = s.plan
            self.runner.complete(s.handle, self.scheduler.grammar_masks(s.plan, self.runner.words))
            self._failing = None

    def _finalize(self, s: InFlightStep) -> None:
        self._failing = s.plan
        result = self.runner.finalize(s.handle)
        outputs = self.scheduler.update(s.plan, result)
        self._out += outputs
        self._failing = None
        end = self.clock()
        tokens = sum(len(o.new_token_ids) for o in outputs)
        seconds = end - max(s.launched, self._last_end)
        self.num_fresh += s.fresh
        self.scheduler.gain.timed(s.plan.step_id, tokens, seconds, fresh=s.fresh)
        self._last_end = end

    _failing: StepPlan | None = None

    def _recover(self, e: Exception) -> None:
        """A step raised. Drop everything in flight and recreate the runner's KV; every
        running request resumes by prefill, token-exact. Out of device memory: retry with a
        smaller step (the requests of a step that fails at the smallest fail with a clear
        error). Anything else: the requests of the failing step fail with an internal error,
        the rest go on."""
        oom = is_oom(e)
        failing = self._failing
        self.curr, self._failing = None, None
        sched = self.scheduler
        at_floor = sched.max_step_tokens <= sched.config.page_size
        failed: frozenset[str] = frozenset()
        if failing is None:
            # Not inside a step's launch or finalize: the engine's own state is suspect, so
            # nothing running may retry into the same failure.
            failed = frozenset(sched.running)
        elif not oom or at_floor:
            failed = failing.request_ids
        log.error(
            "step failed (%s: %s); %d requests fail, the rest resume",
            type(e).__name__,
            e,
            len(failed),
            exc_info=None if oom else e,
        )
        e.__traceback__ = None  # its frames hold the failed step's arrays
        self.runner.reset()
        kind = "out of device memory" if oom else "internal error"
        sched.recover(failed, f"{kind} in an engine step: {type(e).__name__}: {e}", oom=oom)

    def _check(self) -> None:
        if self.check_invariants:
            self.scheduler.check_invariants(self.inflight)
