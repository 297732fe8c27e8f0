"""After a failed step: the runner has dropped every in-flight step and its KV; the
scheduler's accounting of them is undone and every running request resumes by prefill (or,
where it was the failure, ends with an error)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tandem.engine.request import Request
from tandem.outputs import EngineOutput

if TYPE_CHECKING:
    from tandem.engine.scheduler import Scheduler


def recover(sched: Scheduler, failed: Iterable[str], error: str | None, *, oom: bool) -> None:
    """Undo the lost steps' accounting and retract every running request, in order; the
    requests in ``failed`` end with ``error`` instead (kind: resource after an OOM, else
    internal). After an out-of-memory error the step token budget halves, so the retry
    needs less."""
    failed = set(failed)
    sched.stats.step_failures += 1
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
            sched._retract(req, cache=False)
    if sched.kv.states is not None:
        # Slots a plan that never launched had taken have no holder to give them back.
        sched.kv.states.reset()


def _fail(sched: Scheduler, req: Request, error: str, kind: str) -> None:
    sched.finish(req, "error", emit=False)
    sched._pending.append(EngineOutput(req.request_id, (), "error", error=error, error_kind=kind))
    if req.request_id in sched.running:
        sched.maybe_release(req, cache=False)
