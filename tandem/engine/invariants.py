"""Scheduler invariants, checked after every loop iteration in tests (``check_invariants``).

Pages: the allocator's books balance; every page is free, or held with exactly as many
references as page tables (of running requests) and the prefix cache list it; pages in use
plus cached never exceed the pool. Requests: each is in one state; in-flight counts match
the steps in flight; a decode's KV accounting matches its tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.plan import StepPlan
from tandem.engine.request import RequestStatus

if TYPE_CHECKING:
    from tandem.engine.scheduler import Scheduler


def check(sched: Scheduler, inflight: list[StepPlan]) -> None:
    kv = sched.kv
    alloc = kv.alloc
    alloc.check()
    if kv.tree is not None:
        kv.tree.check()
    assert alloc.num_used + alloc.num_free == alloc.num_pages
    assert kv.num_held + kv.num_cached <= alloc.num_pages, "pages over the pool"
    expected = kv.tree.page_refs() if kv.tree is not None else {}
    for req in sched.running.values():
        assert len(set(req.pages)) == len(req.pages), f"{req.request_id} lists a page twice"
        assert not set(req.pages) & req.locked_pages, f"{req.request_id} locks its own page"
        for p in [*req.pages, *req.locked_pages]:
            expected[p] = expected.get(p, 0) + 1
    for p, r in enumerate(alloc.refs):
        assert r == expected.get(p, 0), f"page {p}: {r} references, {expected.get(p, 0)} holders"

    if sched.state_slots is not None:
        sched.state_slots.check([r.state_slot for r in sched.running.values()])
        assert all(r.state_slot == -1 for r in sched.waiting), "a waiting request holds state"
    if kv.snapshots is not None:
        assert kv.tree is not None
    if kv.states is not None:
        holders = kv.tree.snapshot_refs() if kv.snapshots is not None else {}
        for req in sched.running.values():
            for slot in (req.state_src, req.checkpoint, req.spec_backup):
                if slot >= 0:
                    holders[slot] = holders.get(slot, 0) + 1
            assert req.checkpoint >= 0 or req.checkpoint_pos == 0 or req.finished
            assert req.spec_backup < 0 or req.spec_inflight, "a backup with no verify"
        kv.states.check(holders)
        for req in sched.waiting:
            assert req.state_src == req.checkpoint == req.spec_backup == -1, (
                "a waiting request holds a snapshot"
            )

    waiting_ids = [r.request_id for r in sched.waiting]
    assert len(set(waiting_ids)) == len(waiting_ids), "a request waits twice"
    assert not set(waiting_ids) & sched.running.keys(), "a request is in two states"
    assert set(waiting_ids) == sched._waiting_ids, "waiting index out of sync"
    refs: dict[str, int] = {}
    samples: dict[str, int] = {}
    for plan in inflight:
        for rid in plan.request_ids:
            refs[rid] = refs.get(rid, 0) + 1
        for rid in plan.sample_request_ids:
            samples[rid] = samples.get(rid, 0) + 1
        for seg in plan.segments:
            assert seg.end <= len(seg.pages) * kv.page_size, "a segment writes past its pages"
    for req in sched.waiting:
        assert req.status is RequestStatus.WAITING and not req.pages and not req.locked_pages
    for rid, req in sched.running.items():
        assert req.num_inflight == refs.get(rid, 0), f"{rid}: in-flight count is off"
        assert req.num_pending_samples == samples.get(rid, 0), f"{rid}: pending samples off"
        assert req.num_computed <= len(req.pages) * kv.page_size, f"{rid}: KV past its pages"
        if req.finished:
            assert req.num_inflight > 0, f"{rid} finished but was not released"
        elif req.status is RequestStatus.DECODE:
            expected_len = req.num_tokens - 1 + req.num_pending_samples
            assert req.num_computed == expected_len, f"{rid}: KV accounting is off"
        else:
            assert req.num_computed < req.num_tokens, f"{rid}: prefill overran"
    for rid in refs:
        assert rid in sched.running, f"in-flight step references released {rid}"
