"""Proposals from a draft model: a smaller model with the target's tokenizer, run by the
runner on its own KV pool (runner/draft.py), queried by the scheduler while it builds a step.

The draft's pool has as many pages as the target's and is indexed by the same page ids, so a
request's page table serves both: nothing is allocated for the draft. The draft does not
follow every target step (at a large batch nobody speculates, and a draft forward on every
step would cost host work for nothing); instead each request remembers how far the draft's
KV of it is valid (``SpecState.draft_len``), and a proposal first feeds the draft what it has
not seen — the positions from there up to the request's last token, a prefill chunk — then
runs ``k`` greedy draft steps. On a verify the draft's KV stays valid up to the last accepted
proposal it wrote; a retraction or a failed step starts it from 0 again.

What the draft's KV holds never decides a token: a verify accepts a proposal only where the
target samples it (engine/speculation.py), so a stale or garbage draft cache costs
acceptance, never exactness. That is what makes the sharing safe: a prefix-cache hit's pages
hold the draft KV that whichever request last wrote them left there (always of the same
tokens, since equal page content is what a hit means), and a draft that fails mid-step is
reset and proposes nothing that step.

Proposals are the draft's argmax; for sampled rows that is a one-token (one-hot) draft
distribution, whose rejection rule the verify already applies exactly (speculation.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tandem.engine import recovery, speculation
from tandem.engine.plan import DraftQuery

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.engine.scheduler import Scheduler

log = logging.getLogger("tandem")


class Proposer(Protocol):
    """The runner's draft model. ``propose`` returns each query's ``k`` proposed tokens, or
    None when the draft failed (it has reset its pool: every request's draft KV is gone)."""

    max_tokens: int  # catch-up tokens one call may feed
    disabled: bool  # failed too often: no more proposals

    def propose(self, queries: Sequence[DraftQuery]) -> list[list[int]] | None: ...


def allocate(
    sched: Scheduler, decodes: list[tuple[Request, int]], proposals: dict[str, list[int]]
) -> tuple[dict[str, list[int]], list[DraftQuery]]:
    """Pages for the step's decodes and their proposals, then (with a draft model) the
    proposals' tokens or the step's draft queries (``draft``)."""
    kv = sched.kv
    drafting = sched.proposer is not None and bool(proposals)
    pages_before = {r.request_id: len(r.pages) for r, _ in decodes} if drafting else {}
    page, windowed = kv.page_size, kv.walloc is not None
    for req, _ in decodes:  # first: a draft writes its proposals' positions
        end = req.num_computed + 1
        if proposals:
            end += len(proposals.get(req.request_id, ()))
        short = -(-end // page) - len(req.pages)  # (kv.pages_for, inlined: every row, step)
        if short > 0:
            req.pages += kv.allocate(short)
        if windowed:
            kv.grow_window(req, end)
    if not drafting:
        return proposals, []
    return draft(sched, proposals, pages_before)


def on_host(req) -> bool:
    """Whether a request's proposals must be on the host before its step is built: a
    grammar masks each verify row after the proposals before it, and a penalty counts them
    as output (engine/sampling_rows.py). The others' proposals ride the step itself."""
    return req.grammar is not None or req.params.penalized


def draft(
    sched: Scheduler, proposals: dict[str, list[int]], pages_before: dict[str, int]
) -> tuple[dict[str, list[int]], list[DraftQuery]]:
    """Turn placeholder ``proposals`` (their lengths are what the step has room for; pages
    for them are allocated) into draft queries. Those of requests that need their
    proposals on the host run now and come back as tokens, trimmed like any proposal; the
    rest are returned for the step to run (their proposals stay placeholders, and the
    verify segment names its query). A request whose draft is too far behind for this
    step's catch-up budget only catches up, and decodes one token. Pages allocated for
    proposals that came back shorter are given back (no step lists them yet: nothing is in
    flight while anyone speculates)."""
    assert sched.proposer is not None
    room = min(sched.max_step_tokens, sched.proposer.max_tokens)
    cap = recovery.prefill_cap(sched)  # one request's catch-up, as a prefill chunk's
    now: list[DraftQuery] = []
    lazy: list[DraftQuery] = []
    for rid, placeholder in proposals.items():
        req = sched.running[rid]
        pos = req.num_computed  # the last token's position
        start = min(req.spec.draft_len, pos)
        n, k = pos + 1 - start, len(placeholder)
        if n > min(room, cap):
            n, k = min(room, cap), 0
        if n <= 0:
            continue
        room -= n
        tokens = tuple(req.token_slice(start, start + n))
        q = DraftQuery(rid, start, tokens, tuple(req.pages), k)
        (now if k and on_host(req) else lazy).append(q)
    out: dict[str, list[int]] = {}
    if now:
        got = sched.proposer.propose(now)
        if got is None:
            log.warning("the draft model failed; its KV is rebuilt as requests speculate again")
            speculation.draft_lost(sched)
            for q in now:  # counts against them, as a verify that accepted nothing
                sched.running[q.request_id].spec.no_proposal(sched.config.speculation)
            now, lazy, got = [], [], []
        for q, tokens in zip(now, got, strict=True):
            req = sched.running[q.request_id]
            proposal = speculation.trim(req, list(tokens))
            # Written: the query's tokens and the first k - 1 proposals; valid for as long
            # as the proposals before them are (a verify cuts draft_len back to the accepted).
            req.spec.draft_len = q.end + min(len(proposal), q.k - 1)
            if proposal:
                out[q.request_id] = proposal
            else:
                req.spec.no_proposal(sched.config.speculation)
    for q in lazy:
        sched.running[q.request_id].spec.draft_len = q.end + max(0, q.k - 1)
        if q.k:
            out[q.request_id] = [0] * q.k  # placeholders: the step feeds the draft's
    kv = sched.kv
    for rid in proposals:
        req = sched.running[rid]
        keep = max(pages_before[rid], kv.pages_for(req.num_computed + 1 + len(out.get(rid, ()))))
        kv.truncate(req, keep)
    return out, lazy
