"""Retraction: a running request gives its pages back and queues again, to resume by
prefill. Under KV pressure (``fit``: the most recently admitted first, while the decodes'
next pages do not fit), and after a failed step (``recover``): the runner has dropped every
in-flight step and its KV; the scheduler's accounting of them is undone and every running
request resumes by prefill (or, where it was the failure, ends with an error)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tandem.engine.request import Request, RequestStatus
from tandem.outputs import EngineOutput

if TYPE_CHECKING:
    from tandem.engine.scheduler import Scheduler


REGROW_AFTER = 64  # good steps before a shrunk step budget doubles back


def regrow_budget(sched: Scheduler) -> None:
    """After an OOM the step budget halved; it doubles back (up to the configured one)
    after every REGROW_AFTER steps without a failure."""
    if sched.max_step_tokens >= sched.config.max_num_batched_tokens:
        return
    sched._good_steps += 1
    if sched._good_steps >= REGROW_AFTER:
        sched._good_steps = 0
        sched.max_step_tokens = min(sched.config.max_num_batched_tokens, 2 * sched.max_step_tokens)


def prefill_cap(sched: Scheduler) -> int:
    """One request's prefill (or draft catch-up) tokens this step: ``max_prefill_chunk``
    (0: the whole budget), shrunk in proportion while an OOM has shrunk the step budget, so
    a long prompt's chunk, the likeliest cause, shrinks with the first halving."""
    cfg = sched.config
    budget = sched.max_step_tokens
    if not cfg.max_prefill_chunk:
        return budget
    return max(1, min(budget, cfg.max_prefill_chunk * budget // cfg.max_num_batched_tokens))


def recover(sched: Scheduler, failed: Iterable[str], error: str | None, *, oom: bool) -> None:
    """Undo the lost steps' accounting and retract every running request, in order; the
    requests in ``failed`` end with ``error`` instead (kind: resource after an OOM, else
    internal). After an out-of-memory error the step token budget halves, so the retry
    needs less."""
    failed = set(failed)
    sched.stats.step_failures += 1
    sched.gain.forget()  # the lost steps are never timed
    sched._good_steps = 0
    if oom:
        sched.stats.oom_recoveries += 1
        sched.max_step_tokens = max(sched.config.page_size, sched.max_step_tokens // 2)
    # The pool's contents are gone: nothing may stay cached.
    sched.kv.clear_cache()
    for req in reversed(list(sched.running.values())):
        req.num_inflight = req.num_pending_samples = 0
        req.spec_inflight = False
        if req.finished:
            sched.maybe_release(req, cache=False)
        elif req.request_id in failed:
            _fail(sched, req, error or "step failed", "resource" if oom else "internal")
        else:
            retract(sched, req, cache=False)
    if sched.kv.states is not None:
        # Slots a plan that never launched had taken have no holder to give them back.
        sched.kv.states.reset()
    if sched.kv.positions is not None:
        sched.kv.positions.reset()  # (the runner's held states went with its pool)


def fit(sched: Scheduler) -> None:
    """Nothing is in flight: while the running decodes' next tokens need more pages than
    the pool can give (or, with a window group, no request can get the window page it
    needs next), retract the most recently admitted request."""
    kv = sched.kv
    if kv.walloc is not None:  # no step reads behind any request's window now
        for r in sched.running.values():
            if not r.finished:
                kv.free_behind(r, r.num_computed)
    while True:
        live = [r for r in sched.running.values() if not r.finished]
        decodes = [r for r in live if r.status is RequestStatus.DECODE]
        need = sum(r.num_computed // kv.page_size >= len(r.pages) for r in decodes)
        wneed = sum(kv.window_need(r, r.num_computed + 1) for r in decodes)
        stuck = (
            kv.walloc is not None
            and not decodes
            and all(kv.window_need(r, r.num_computed + 1) > kv.window_available() for r in live)
        )
        fits = need <= kv.available() and wneed <= kv.window_available() and not stuck
        if fits or not live:
            return
        retract(sched, max(live, key=lambda r: r.admit_order))


def retract(sched: Scheduler, req: Request, *, cache: bool = True) -> None:
    """Give a running request's pages back (its written whole pages stay cached) and queue
    it first; it resumes by prefilling its prompt and output so far, from the cache where
    the pages are still there."""
    assert req.num_inflight == 0
    if cache:
        sched._cache(req)
    sched._release(req)
    req.status = RequestStatus.WAITING
    req.num_computed = 0
    req.num_retractions += 1
    # A resumed sample of n > 1 must not wait for its leader: the leader may be queued
    # behind it now, and its prompt KV may be gone anyway.
    req.follows = None
    if not req.cache_reported:
        req.prompt_logprobs = None  # recomputed in full by the re-prefill
    sched.stats.retractions += 1
    del sched.running[req.request_id]
    sched.waiting.appendleft(req)
    sched._waiting_ids.add(req.request_id)
    sched.admission.blocked = False


def _fail(sched: Scheduler, req: Request, error: str, kind: str) -> None:
    sched.finish(req, "error", emit=False)
    sched._pending.append(EngineOutput(req.request_id, (), "error", error=error, error_kind=kind))
    if req.request_id in sched.running:
        sched.maybe_release(req, cache=False)
