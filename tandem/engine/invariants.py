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
    if kv.walloc is not None:
        _check_window(sched, inflight)

    if sched.state_slots is not None:
        sched.state_slots.check([r.state_slot for r in sched.running.values()])
        assert all(r.state_slot == -1 for r in sched.waiting), "a waiting request holds state"
    if kv.snapshots is not None:
        assert kv.tree is not None
    if kv.states is not None:
        holders = kv.tree.snapshot_refs() if kv.snapshots is not None else {}
        held: list[int] = []  # per-position state ids (kv.positions)
        for req in sched.running.values():
            for slot in (req.state_src, req.checkpoint, req.spec_backup, *req.spec_positions):
                if slot >= 0 and kv.positions is not None and slot in kv.positions:
                    assert slot in req.spec_positions or (
                        slot == req.state_src and req.status is RequestStatus.DECODE
                    ), f"position id {slot} held as a checkpoint or backup"
                    held.append(slot)
                elif slot >= 0:
                    holders[slot] = holders.get(slot, 0) + 1
            assert req.checkpoint >= 0 or req.checkpoint_pos == 0 or req.finished
            assert req.spec_backup < 0 or req.spec_inflight, "a backup with no verify"
            assert not req.spec_positions or req.spec_inflight, "position states, no verify"
        kv.states.check(holders)
        if kv.positions is not None:
            kv.positions.check(held)
        for req in sched.waiting:
            assert req.state_src == req.checkpoint == req.spec_backup == -1, (
                "a waiting request holds a snapshot"
            )
            assert not req.spec_positions, "a waiting request holds a snapshot"

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
            if seg.state_positions:  # the verify's request holds them until its result
                owner = sched.running[seg.request_id]
                assert owner.spec_positions == seg.state_positions, "position ids drifted"
        _check_state_stores(plan)
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


def _check_state_stores(plan: StepPlan) -> None:
    """No state slot a step stores into is one another request of the step reads: stored
    in place (runner/state.py), such a store is ordered after nothing but its own values,
    so it could overtake the other request's read."""
    readers: dict[int, set[str]] = {}
    for seg in plan.segments:
        if seg.state_slot >= 0:
            readers.setdefault(seg.state_read, set()).add(seg.request_id)
    for seg in plan.segments:
        stores = [seg.state_slot, seg.state_backup, *(slot for _, slot in seg.snapshots)]
        for slot in stores:
            if slot >= 0:
                assert readers.get(slot, set()) <= {seg.request_id}, (
                    f"state slot {slot}: stored by {seg.request_id}, read by another request"
                )


def _check_window(sched: Scheduler, inflight: list[StepPlan]) -> None:
    """The window group: references balance; a request's window pages cover what it has
    written except wholly behind the window; every page an in-flight step reads (the last
    W positions before each of its tokens) is still the request's."""
    kv = sched.kv
    walloc = kv.walloc
    assert walloc is not None
    walloc.check()
    expected = kv.tree.wpage_refs() if kv.tree is not None else {}
    for req in sched.running.values():
        held = [pg for pg in req.wpages if pg >= 0]
        assert len(set(held)) == len(held), f"{req.request_id} lists a window page twice"
        assert all(pg < 0 for pg in req.wpages[: req.wfree]), "a page below wfree is held"
        for pg in held:
            expected[pg] = expected.get(pg, 0) + 1
        if not req.finished and req.num_computed:
            lo = max(0, req.num_computed - kv.window + 1) // kv.page_size
            top = kv.pages_for(req.num_computed)
            assert len(req.wpages) >= top, f"{req.request_id}: written past its window pages"
            assert all(pg >= 0 for pg in req.wpages[lo:top]), (
                f"{req.request_id}: a window page inside the window is gone"
            )
    for p, r in enumerate(walloc.refs):
        assert r == expected.get(p, 0), f"window page {p}: {r} refs, {expected.get(p, 0)} holders"
    for plan in inflight:
        for seg in plan.segments:
            req = sched.running[seg.request_id]
            lo = max(0, seg.start - kv.window + 1) // kv.page_size
            for i in range(lo, kv.pages_for(seg.end)):
                assert seg.wpages[i] >= 0, f"{seg.request_id} reads a freed window page"
                if not req.finished and i < len(req.wpages):
                    assert req.wpages[i] == seg.wpages[i], (
                        f"{seg.request_id}: window page {i} freed while a step reads it"
                    )
