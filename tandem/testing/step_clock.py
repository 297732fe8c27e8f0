"""A loop clock for tests: advanced by each finalize, by one cost for a plain step and
another for a step with a verify (engine/spec_gain.py judges speculation by it)."""

from __future__ import annotations

from typing import Any


def step_clock(loop: Any, plain: float, verify: float) -> list[float]:
    """Wrap ``loop``'s runner so each finalize advances the loop's clock by ``plain`` or,
    where the step held a verify segment, ``verify``; returns the clock's [now]."""
    runner = loop.runner
    now, plans = [0.0], {}
    launch, finalize = runner.launch, runner.finalize

    def launching(plan, *args, **kw):
        handle = launch(plan, *args, **kw)
        plans[id(handle)] = plan
        return handle

    def finalizing(handle):
        plan = plans.pop(id(handle))
        now[0] += verify if any(s.num_samples > 1 for s in plan.segments) else plain
        return finalize(handle)

    runner.launch, runner.finalize = launching, finalizing
    loop.clock = lambda: now[0]
    return now
