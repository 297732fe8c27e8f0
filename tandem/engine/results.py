"""Applying a finalized step to request state (tokens, stops, grammar verdicts, prompt
log-probabilities, late release), and the grammar masks a step's constrained rows need."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tandem.engine import recovery, spec_shadow, speculation
from tandem.engine.grammar import Matcher, accept_all, fill_masks
from tandem.engine.plan import Segment, StepPlan, StepResult
from tandem.engine.request import Request, RequestStatus
from tandem.outputs import EngineOutput

if TYPE_CHECKING:
    from tandem.engine.scheduler import Scheduler


def apply(sched: Scheduler, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
    """Apply a finalized step (strictly in launch order): append tokens, detect stops."""
    assert result.step_id == plan.step_id
    outputs: list[EngineOutput] = []
    if result.draft_failed:  # (the step's proposals were placeholders: still exact)
        speculation.draft_lost(sched)
    for rid, entries in (result.prompt_logprobs or {}).items():
        req = sched.running[rid]
        req.prompt_logprobs = (req.prompt_logprobs or []) + entries
    # Grammar rows consume their tokens first, together (llguidance's threads for many);
    # a stop token is an end, not grammar text.
    # (A verify segment's rows consume their accepted run in _verified.)
    verifies = {s.sample_row: s for s in plan.segments if s.num_samples > 1}
    rest = {r for s in verifies.values() for r in s.later_rows}
    accepted: dict[int, bool] = {}
    if plan.sampling.constrained:
        guided = []
        for row in plan.sampling.constrained:
            req = sched.running[plan.sample_request_ids[row]]
            token = result.tokens[row]
            skip = row in verifies or row in rest
            if not req.finished and token not in req.stop_ids and not skip:
                guided.append((row, req.grammar, token))
        verdicts = accept_all([(g, t) for _, g, t in guided])
        accepted = {row: ok for (row, _, _), ok in zip(guided, verdicts, strict=True)}
    # (Per row and step: the common row's checks are kept to plain attribute tests.)
    finished = RequestStatus.FINISHED
    shadowing = spec_shadow.applies(sched, plan)
    logprobs = result.logprobs
    for row, (rid, token) in enumerate(zip(plan.sample_request_ids, result.tokens, strict=True)):
        req = sched.running[rid]
        if verifies and (row in verifies or row in rest):
            if row in verifies:  # a verify segment's rows: all of them at its first
                out = _verified(sched, req, verifies[row], result)
                if out is not None:
                    outputs.append(out)
            continue
        req.num_pending_samples -= 1
        if req.spec is not None:
            req.spec.plain_tokens(1)
        if req.status is finished:
            continue  # finished earlier in the chain; this token is past its end
        if req.grammar is not None and not accepted.get(row, True):
            # Masks make this impossible; if it happens the request fails alone.
            error = f"grammar rejected token {token}: {req.grammar.error or 'not allowed'}"
            sched.finish(req, "error", emit=False)
            outputs.append(EngineOutput(rid, (), "error", error=error, error_kind="internal"))
            continue
        req.output_token_ids.append(token)
        reason = _end_reason(req, token)
        if reason is not None:
            sched.finish(req, reason, emit=False)
        if shadowing and req.spec is not None:
            spec_shadow.observe(sched, req)
        cached, prompt_lps = (None, None) if req.cache_reported else _first_report(req)
        lp = logprobs.get(row) if logprobs else None
        outputs.append(
            EngineOutput(
                rid,
                (token,),
                reason,
                cached_tokens=cached,
                logprobs=(lp,) if lp is not None else None,
                prompt_logprobs=prompt_lps,
            )
        )
    windowed = sched.kv.walloc is not None
    for seg in plan.segments:
        req = sched.running[seg.request_id]
        req.num_inflight -= 1
        if req.status is finished:
            sched.maybe_release(req)
        elif windowed:  # window pages no later step reads (the one in flight starts later)
            sched.kv.free_behind(req, seg.start)
    recovery.regrow_budget(sched)
    # Outputs not tied to a step (aborts) go first; taken last, so a failure above
    # leaves them queued for the loop instead of dropping them.
    return sched.take_pending_outputs() + outputs


def _verified(sched: Scheduler, req: Request, seg: Segment, result: StepResult):
    """Apply a verify segment's rows: the accepted tokens up to the first stop, the KV
    length cut back to them, whole pages past it released (no other step lists them: the
    request sat out every step launched since). Returns its output (None if it had
    finished earlier)."""
    row, n = seg.sample_row, seg.num_samples
    req.num_pending_samples -= n
    req.spec_inflight = False
    if req.finished:
        _roll_back(sched, req, seg, n)
        return None
    proposal = seg.token_ids[1:]
    if seg.draft >= 0:  # the draft's proposals, made in the step
        assert result.drafted is not None
        proposal = result.drafted[req.request_id]
    tokens = speculation.accepted_tokens(proposal, result.tokens[row : row + n])
    if result.draft_failed and seg.draft >= 0:  # placeholders, not proposals
        req.spec.no_proposal(sched.config.speculation)
    else:
        stats = sched.stats
        stats.spec_proposed += len(proposal)
        stats.spec_accepted += len(tokens) - 1
        stats.spec_verifies += 1
        req.spec.record(sched.config.speculation, len(proposal), len(tokens) - 1)
        sched.acceptance.record(len(proposal), len(tokens) - 1)
    emitted: list[int] = []
    reason = None
    for token in tokens:
        grammar = req.grammar
        if grammar is not None and token not in req.stop_ids and not grammar.accept(token):
            # Masks make this impossible; if it happens the request fails alone.
            error = f"grammar rejected token {token}: {grammar.error or 'not allowed'}"
            sched.finish(req, "error", emit=False)
            _roll_back(sched, req, seg, 0)
            return EngineOutput(req.request_id, (), "error", error=error, error_kind="internal")
        req.output_token_ids.append(token)
        emitted.append(token)
        reason = _end_reason(req, token)
        if reason is not None:
            sched.finish(req, reason, emit=False)
            break
    req.num_computed = seg.start + len(emitted)
    req.spec.draft_len = min(req.spec.draft_len, req.num_computed)
    sched.kv.truncate(req, sched.kv.pages_for(req.num_computed + 1))
    _roll_back(sched, req, seg, len(emitted))
    cached, prompt_lps = _first_report(req)
    lps = None
    if result.logprobs:
        found = [result.logprobs.get(row + i) for i in range(len(emitted))]
        lps = tuple(found) if None not in found else None
    return EngineOutput(
        req.request_id,
        tuple(emitted),
        reason,
        cached_tokens=cached,
        logprobs=lps,
        prompt_logprobs=prompt_lps,
    )


def _roll_back(sched: Scheduler, req: Request, seg: Segment, emitted: int) -> None:
    """A model with recurrent layers: the verify advanced the request's state over every
    token it fed. Where all were accepted that is the request's state; otherwise it resumes
    from the state before the verify (its backup) by replaying the accepted tokens as a
    prefill chunk that samples the next one. Their KV is written again, with the values it
    has. Where the verify kept its states per position, the request resumes from the one
    after its last accepted token instead, and needs no replay."""
    if seg.state_positions:
        assert req.spec_positions == seg.state_positions
        req.spec_positions = ()
        resume = -1
        if not req.finished and emitted < seg.num_tokens:
            assert req.state_src < 0 and emitted > 0
            resume = req.state_src = seg.state_positions[emitted - 1]
        for slot in seg.state_positions:
            if slot != resume:
                sched.kv.drop_snapshot(slot)
        return
    if seg.state_backup < 0:
        return
    assert req.spec_backup == seg.state_backup
    req.spec_backup = -1
    if req.finished or emitted == seg.num_tokens:
        sched.kv.drop_snapshot(seg.state_backup)
        return
    assert req.state_src < 0
    req.state_src = seg.state_backup  # the replay's chunk reads it (and drops it)
    req.num_computed = seg.start
    req.status = RequestStatus.PREFILL
    req.replaying = True


def _end_reason(req: Request, token: int) -> str | None:
    """Why ``token`` (just appended) ends the request, if it does."""
    if token in req.stop_ids:
        return "stop"
    if len(req.output_token_ids) >= req.params.max_tokens:
        return "length"
    if req.grammar is not None and req.grammar.done:
        return "stop"  # the grammar is complete: nothing but the end may follow
    return None


def _first_report(req: Request) -> tuple[int | None, list | None]:
    """With a request's first output: its cached prompt tokens and prompt logprobs."""
    if req.cache_reported:
        return None, None
    req.cache_reported = True
    prompt_lps, req.prompt_logprobs = req.prompt_logprobs, None
    return req.num_cached_tokens, prompt_lps


def grammar_masks(sched: Scheduler, plan: StepPlan, words: int) -> np.ndarray | None:
    """Allowed-token bitmasks (int32, ``words`` per row) of the plan's constrained rows,
    from each request's grammar after all its finalized tokens. Call it when the step
    before ``plan`` is finalized (for a chained plan: after its parent)."""
    rows = plan.sampling.constrained
    if not rows:
        return None
    masks = np.full((len(rows), words), -1, dtype=np.int32)
    drafted = {row: s for s in plan.segments for row in s.later_rows}
    matchers: list[Matcher | None] = []  # rows whose mask is the matcher's as it stands
    owners: list[Matcher | None] = []
    after: dict[int, list[int]] = {}  # a verify segment's first row -> its later rows' masks
    for idx, row in enumerate(rows):
        req = sched.running.get(plan.sample_request_ids[row])
        m = None
        if req is not None and not req.finished and req.grammar is not None:
            assert req.grammar.consumed == len(req.output_token_ids), "mask computed early"
            m = req.grammar
        owners.append(m)
        if row in drafted:
            matchers.append(None)
            if m is not None:
                after.setdefault(drafted[row].sample_row, []).append(idx)
        else:
            matchers.append(m)  # None: finished in the chain, its token is discarded
    fill_masks(matchers, masks)
    for first, idxs in after.items():
        m = owners[idxs[0]]
        assert m is not None
        m.masks_after(drafted[first + 1].token_ids[1:], [masks[i] for i in idxs])
    bits = masks.view(np.uint32)
    for i, m in enumerate(owners):
        if m is None or m.eos is None or not bits[i, m.eos >> 5] >> (m.eos & 31) & 1:
            continue
        # Where the grammar may end, so may the request's own stop tokens.
        req = sched.running[plan.sample_request_ids[rows[i]]]
        for t in req.stop_ids:
            if t < words * 32:
                bits[i, t >> 5] |= np.uint32(1 << (t & 31))
    return masks
