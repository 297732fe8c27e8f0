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

Opt-in (``host_thread``, off by default: on the H100 it gave no end-to-end gain, see
docs/design.md): when the host sets the pace (a steady step's finalize finds its step already
done: large batches on a GPU), the loop reorders the same phases so the host's Python runs
beside the submission, which releases the GIL (measured on the H100: another thread runs at
0.95-0.99 of its own rate during ``mx.async_eval``). Step N+1 is built but held back; N is
finalized first (nothing else touches MLX then), then N+1 is submitted on this thread while a
helper thread applies N's results and plans N+2 (pure Python: the scheduler never imports
MLX). N+2 is built once both are done. The plans, their order and every token are the ones
the plain order gives; a request that arrives between steps joins one step later.
(docs/design.md, "Host work beside the submission"; the policy is at HOST_BOUND_WAIT below.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
    ``reset`` drops every in-flight step and recreates the KV pool (after a failure);
    ``close`` lets go of the pools and the model for good."""

    words: int  # int32 words of a grammar bitmask row
    # Whether ``host_thread=None`` may hand host work to the helper (a device apart from the
    # host's cores: a GPU; on the CPU backend the device shares them).
    host_thread_auto: bool

    @property
    def shapes(self) -> int:
        """Compiled step shapes met so far: a launch that meets a new one traces it."""
        ...

    def launch(
        self, plan: StepPlan, parent: Any | None, masks: Any | None = None, *, submit: bool = True
    ) -> Any:
        """``submit=False``: build the step and hold it back until ``submit``."""
        ...

    def submit(self, handle: Any) -> None: ...

    def complete(self, handle: Any, masks: Any) -> None: ...

    def finalize(self, handle: Any) -> StepResult: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class InFlightStep:
    plan: StepPlan
    handle: Any
    launched: float = 0.0  # the clock when its launch began
    # Its time is not a steady step's: its launch, or a child's launched before it
    # finalized, met a new shape (traced: the model's Python, then MLX compiling kernels).
    fresh: bool = False
    submitted: bool = True  # False: built on its parent's tokens, held back (host_thread)


# A finalize that waited less than HOST_BOUND_WAIT found its step already done: the host, not
# the device, set the pace. After HOST_BOUND_STEPS such steps in a row whose host work
# (planning and applying results) took HOST_WORK_MIN or more, the loop runs that work beside
# the submissions (``host_thread``; less is not worth the hand-over: on this repository's CPU
# at 8 rows, 0.11 ms of it, the thread made a step 1.2-1.4x slower). It turns back when a
# finalize waits longer than the host work the thread hides (the device sets the pace again)
# or the work shrinks, and then needs HOST_BACKOFF_STEPS + HOST_BOUND_STEPS more such steps
# before it tries again. Only with ``host_thread=None`` (automatic; the default is off) and
# where the runner's ``host_thread_auto`` says the device is apart from the host.
HOST_BOUND_WAIT = 2.5e-4
HOST_BOUND_STEPS = 4
HOST_WORK_MIN = 5e-4
HOST_BACKOFF_STEPS = 32


class OverlapLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        overlap: bool = True,
        check_invariants: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        host_thread: bool | None = False,
    ) -> None:
        """``host_thread``: apply results and plan beside the submission (module docstring):
        None when the host sets the pace and the runner's device is apart from the host
        (``host_thread_auto``), True whenever a step allows it, False never."""
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.host_thread = host_thread
        self.pending: InFlightStep | None = None  # built on curr's tokens, not yet submitted
        self.num_threaded = 0  # steps whose host work ran beside a submission
        self._paced = 0  # steps in a row the host set the pace (negative: backing off)
        self._waited = 0.0  # the last finalize's wait
        self._work = 0.0  # the last step's planning and applying (s)
        self._planned = self._applied = 0.0  # (their parts, in the plain order)
        self._helper: ThreadPoolExecutor | None = None
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
        return [s.plan for s in (self.curr, self.pending) if s is not None]

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
        if self.pending is not None or self._threaded():
            self._step_threaded()
            self._check()
            return
        # 1. Submit step N+1 on N's lazy tokens before blocking on N. With constrained rows
        # only its forward goes now; its sampling waits for the masks (step 2).
        nxt = self._launch(self.curr) if self.overlap else None
        if nxt is not None and nxt.fresh:
            self.curr.fresh = True  # (N's interval holds N+1's tracing)
        # 2. Finalize N (the device is busy with N+1 meanwhile), then complete N+1.
        self._settle(self.curr, nxt)
        self._check()

    def _settle(self, cur: InFlightStep, nxt: InFlightStep | None) -> None:
        """The plain order from N's finalize on (N+1 submitted): finalize N, then complete
        N+1 and make it current."""
        self._finalize(cur)
        if nxt is None:
            # 3. The chain broke (or overlap is off): a fresh step with nothing in flight.
            self.curr = self._launch(None)
            return
        self._pace()
        self.curr = nxt
        self._complete(nxt)

    def _threaded(self) -> bool:
        # (Never with a draft model: planning may run it, and MLX stays on this thread.)
        if not self.overlap or self.host_thread is False or self.scheduler.proposer is not None:
            return False
        if self.host_thread is None and not self.runner.host_thread_auto:
            return False
        return self.host_thread is True or self._paced >= HOST_BOUND_STEPS

    def _pace(self, threaded: bool = False) -> None:
        """Count a chained step: did its finalize find the step done, with host work worth
        a thread? (module constants)."""
        if threaded:  # (``_work`` measured on the helper)
            if self._waited > max(HOST_BOUND_WAIT, self._work) or self._work < HOST_WORK_MIN:
                self._paced = -HOST_BACKOFF_STEPS
            return
        self._work = self._planned + self._applied
        if self._waited < HOST_BOUND_WAIT and self._work >= HOST_WORK_MIN:
            self._paced += 1
        else:
            self._paced = min(self._paced, 0)

    def _step_threaded(self) -> None:
        cur = self.curr
        assert cur is not None
        nxt, self.pending = self.pending, None
        if nxt is None:
            nxt = self._launch(cur, defer=True)
            if nxt is not None and nxt.fresh:
                cur.fresh = True
        if nxt is None or nxt.submitted or not self._threaded():
            # Nothing held back, or the device sets the pace again: the plain order from
            # N's finalize on.
            if nxt is not None and not nxt.submitted:
                self._submit(nxt)
            self._settle(cur, nxt)
            return
        # N+1 is built on N's lazy tokens. Finalize N first (nothing else touches MLX now),
        # then submit N+1 here while the helper applies N and plans N+2.
        result = self._wait(cur)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="tandem-host")
        # (Plain data only: the helper must never drop the last reference to an array.)
        job = self._helper.submit(
            self._apply_and_plan, cur.plan, cur.launched, cur.fresh, result, nxt.plan
        )
        try:
            self._submit(nxt)
        except BaseException as e:
            job.exception()  # (the helper is done before anything goes on)
            failure = job.result()[2] if isinstance(e, Exception) else None
            if failure is None:
                raise
            # Both failed: the helper's counts (N may be half applied: its requests must
            # fail; N+1's resume with everything else in flight).
            log.error("the submission failed too: %r", e)
            self._failing = failure[1]
            raise failure[0] from e
        plan, launched, failure = job.result()
        self.num_threaded += 1
        self._pace(threaded=True)
        self.curr = nxt
        if failure is not None:
            self._failing = failure[1]
            raise failure[0]
        if plan is not None:
            self.pending = self._build(plan, nxt, launched, defer=True)
            if self.pending.fresh:
                nxt.fresh = True  # (N+1's interval holds N+2's tracing)
        # A None plan: the next step plans again from N+1, as the plain order would. A plan
        # that could not be held back (constrained rows, drafts) went out whole: the next
        # step finalizes N+1 and then completes it, as the plain order does.

    def _apply_and_plan(
        self, done: StepPlan, launched: float, fresh: bool, result: StepResult, parent: StepPlan
    ) -> tuple[StepPlan | None, float, tuple[Exception, StepPlan | None] | None]:
        """On the helper thread: N's results, then N+2's plan (chained on N+1). A failure
        comes back with the plan it belongs to (None: the scheduler's own)."""
        t = self.clock()
        try:
            self._update(done, launched, fresh, result)  # (_failing is the loop thread's)
        except Exception as e:  # noqa: BLE001 - re-raised on the loop's thread
            return None, 0.0, (e, done)
        start = self.clock()
        try:
            plan = self.scheduler.schedule(parent)
        except Exception as e:  # noqa: BLE001
            return None, start, (e, None)
        end = self.clock()
        self._planned, self._work = end - start, end - t
        return plan, start, None

    def _submit(self, s: InFlightStep) -> None:
        self._failing = s.plan
        self.runner.submit(s.handle)
        s.submitted = True
        self._failing = None

    def drain(self) -> list[EngineOutput]:
        """Finalize whatever is in flight (used before shutdown or a pause)."""
        self._out = []
        try:
            if self.pending is not None and not self.pending.submitted:
                self._submit(self.pending)
            if self.curr is not None:
                self._finalize(self.curr)
            if self.pending is not None:
                self._complete(self.pending)  # (a held-back plan's masks, now its parent is in)
                self._finalize(self.pending)
        except Exception as e:  # noqa: BLE001
            self._recover(e)
        self.curr = self.pending = None
        return self._out + self.scheduler.take_pending_outputs()

    def close(self) -> list[EngineOutput]:
        """For good: finish what is in flight (its outputs), stop the helper thread, let go
        of the runner's pools and model."""
        out = self.drain()
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None
        self.runner.close()
        return out

    def _launch(self, parent: InFlightStep | None, *, defer: bool = False) -> InFlightStep | None:
        launched = self.clock()
        plan = self.scheduler.schedule(parent.plan if parent is not None else None)
        self._planned = self.clock() - launched
        if plan is None:
            return None
        return self._build(plan, parent, launched, defer=defer)

    def _build(
        self, plan: StepPlan, parent: InFlightStep | None, launched: float, *, defer: bool = False
    ) -> InFlightStep:
        """Launch ``plan``; with ``defer``, held back (not submitted) where nothing in it
        waits on its parent's finalize: no constrained rows, no draft queries."""
        defer = defer and parent is not None and not plan.sampling.constrained and not plan.drafts
        self.num_steps += 1
        self.num_chained += parent is not None
        self._failing = plan
        # A fresh step knows every constrained row's previous token; a chained one waits.
        masks = None if parent else self.scheduler.grammar_masks(plan, self.runner.words)
        shapes = self.runner.shapes
        handle = self.runner.launch(
            plan, parent.handle if parent else None, masks, submit=not defer
        )
        self._failing = None
        return InFlightStep(plan, handle, launched, self.runner.shapes != shapes, not defer)

    def _complete(self, s: InFlightStep) -> None:
        if s.plan.sampling.constrained:
            self._failing = s.plan
            self.runner.complete(s.handle, self.scheduler.grammar_masks(s.plan, self.runner.words))
            self._failing = None

    def _finalize(self, s: InFlightStep) -> None:
        self._apply(s, self._wait(s))

    def _wait(self, s: InFlightStep) -> StepResult:
        self._failing = s.plan
        t = self.clock()
        result = self.runner.finalize(s.handle)
        self._waited = self.clock() - t
        self._failing = None
        return result

    def _apply(self, s: InFlightStep, result: StepResult) -> None:
        self._failing = s.plan
        self._update(s.plan, s.launched, s.fresh, result)
        self._failing = None

    def _update(self, plan: StepPlan, launched: float, fresh: bool, result: StepResult) -> None:
        t = self.clock()
        outputs = self.scheduler.update(plan, result)
        self._out += outputs
        end = self.clock()
        self._applied = end - t
        tokens = sum(len(o.new_token_ids) for o in outputs)
        seconds = end - max(launched, self._last_end)
        self.num_fresh += fresh
        self.scheduler.gain.timed(plan.step_id, tokens, seconds, fresh=fresh)
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
        self.curr = self.pending = self._failing = None
        self._paced = 0
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
