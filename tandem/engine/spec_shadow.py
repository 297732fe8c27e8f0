"""Shadow proposals: what n-gram speculation would have accepted while it was backed off.

A back-off (a request's after ``patience`` verifies that accepted nothing, or the engine's
after a window of speculating steps that emitted less than plain ones: engine/spec_gain.py)
is blind: it decodes plainly for its length whatever the output does meanwhile. An agent's
rewrite of a file starts with a preamble the prompt does not hold (proposals fail, speculation
backs off) and then copies the file, where proposals would be accepted in full; a blind
back-off decodes that stretch plainly. (The default model on the CPU, rewriting a 1,000-token
source file, 256 tokens at K = 8: speculation was off engine-wide for 96 of ~256 steps,
1.69x plain; docs/benchmarks.md.)

An n-gram proposal costs a dictionary lookup, so while a request decodes plainly with
speculation backed off it still proposes, and the tokens it then decodes tell what a verify
would have accepted (the same rule: the proposals up to the first that differs, settled at
that token, whose place a verify's added token takes, and the next proposal follows it; one
matched in full settles at its last token, and the next proposal starts where a verify would
have added its token). Each such *shadow verify*:
- ends the request's own back-off where it would have accepted at least half its proposal,
  it has a proposal to verify next, and the engine's last judged window paid
  (``SpecGain.paying``);
- counts towards the engine's acceptance rate (new requests start backed off while it is low);
- while the engine's back-off runs (of requests not backed off on their own; a token with
  nothing to propose counts as a verify accepting nothing), the latest few are weighed
  against the window that started it: its step times, scaled by the tokens a row they would
  have emitted, either pay, and speculation resumes, or the back-off runs on
  (``SpecGain.shadowed``).

Only the n-gram proposer shadows (a draft model's proposals cost a forward), only in steps of
at most ``max_batch`` requests (above it speculation is off for the batch size, and a lookup
a row would be host work for nothing), and not a request that started backed off (a cold
start: its prompt is not indexed yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine import speculation

if TYPE_CHECKING:
    from tandem.engine.plan import StepPlan
    from tandem.engine.request import Request
    from tandem.engine.scheduler import Scheduler


def applies(sched: Scheduler, plan: StepPlan) -> bool:
    """Whether a finalized step's plain rows shadow: n-gram speculation, and at most
    ``max_batch`` requests sampled in it (a verify is one request of several rows)."""
    cfg = sched.config.speculation
    if not cfg.enabled or cfg.draft:
        return False
    return sum(s.sample_row >= 0 for s in plan.segments) <= cfg.max_batch


def observe(sched: Scheduler, req: Request) -> None:
    """``req`` decoded a token plainly (its last output token): settle its shadow proposal,
    and make the next one while it stays backed off."""
    spec, gain = req.spec, sched.gain
    assert spec is not None
    if req.finished or spec.cold:  # (a cold start has not indexed its prompt: it waits)
        spec.shadow = []
        return
    pos = len(req.output_token_ids) - 1  # the token's index in the output
    settled = None
    if spec.shadow:
        hits = spec.shadow_hits
        if spec.shadow_at + hits != pos:  # (a verify or a retraction came between)
            spec.shadow = []
        else:
            if req.output_token_ids[pos] == spec.shadow[hits]:
                hits = spec.shadow_hits = hits + 1
                if hits < len(spec.shadow):
                    return
            # It differs (the token a verify adds), or it matched the whole proposal: settle
            # now (a verify would also have emitted the token after it in the same step).
            settled = len(spec.shadow), hits
            spec.shadow = []
    backed_off = not spec.active or gain.off_left > 0
    if not backed_off:
        if settled is not None:
            sched.acceptance.record(*settled)
        return
    proposal = speculation.propose(req, sched.config.speculation)
    if settled is not None:
        # A request resumes only with a proposal in hand (after the token a verify adds, a
        # random model's history often has none, and each step without one is a failure),
        # and while the engine's last judged window paid (else its back-off guards it too).
        spec.shadowed(*settled, ready=bool(proposal) and gain.paying)
        sched.acceptance.record(*settled)
    if spec.active:
        # The engine's back-off weighs the requests that would speculate once it ends: a
        # token with nothing to propose counts as a verify that accepts nothing (a real
        # one's row would emit just that token).
        if settled is not None:
            gain.shadowed(*settled)
        elif not proposal:
            gain.shadowed(0, 0)
    if proposal and (not spec.active or gain.off_left > 0):
        spec.shadow, spec.shadow_at, spec.shadow_hits = proposal, pos + 1, 0
