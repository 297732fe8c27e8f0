"""A model-free runner whose "KV" is the token ids themselves, stored in pages.

The pool has ``num_pages`` pages of ``page_size`` slots; a segment writes its input tokens into
the slots its page table names and a sampled segment's output is a pure function of the
request's seed and the history read back through that page table, ``[0, position]``. So any
KV bookkeeping error (a page shared while both owners write it, a stale cached page, a chained
step accounted at the wrong position, admission over-committing the pool) changes the tokens,
which tests compare against ``fake_token`` run over the true sequence. With a window group
(``window``, ``window_pages``: engine/kv_manager.py) every segment also writes its tokens
into a second pool through its ``wpages``, and each sample's last ``window`` positions read
back through them must equal the history (a window page freed too early and handed to
another request, or a hit missing its window, trips it). It also honours the
launch/finalize contract (launch order, chained steps reading the parent's tokens) and can
inject failures at any phase of a chosen step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.engine.grammar import words_for
from tandem.engine.plan import StepPlan, StepResult

VOCAB = 1000


def fake_token(seed: int, history: Sequence[int]) -> int:
    """The token a request with ``seed`` samples after ``history`` (prompt and outputs)."""
    h = hash(tuple(history)) & 0xFFFFFFFF
    return (seed * 7919 + len(history) * 104729 + h * 31 + 17) % VOCAB


def copying_token(seed: int, history: Sequence[int]) -> int:
    """A fake model that mostly repeats what it saw ``period`` tokens back (period 5 + seed
    % 7), and now and then (one position in 7) does not: n-gram speculation's good case,
    with rejections mid-proposal."""
    period = 5 + seed % 7
    h = fake_token(seed, history)
    if len(history) < period or h % 7 == 0:
        return h
    return history[-period]


def fake_tokens(
    seed: int, prompt: list[int], n: int, token_fn: Callable[[int, Sequence[int]], int] = fake_token
) -> list[int]:
    """The ``n`` tokens a request with ``seed`` generates after ``prompt``."""
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(token_fn(seed, seq))
        seq.append(out[-1])
    return out


@dataclass
class FakeHandle:
    plan: StepPlan
    tokens: tuple[int, ...] | None
    finalized: bool = False
    submitted: bool = True  # False: launched with submit=False, not yet submitted
    raw: tuple[int, ...] = ()  # tokens before grammar masks
    drafted: dict[str, tuple[int, ...]] | None = None
    draft_failed: bool = False


def masked_token(raw: int, mask_row: np.ndarray) -> int:
    """The allowed token a constrained row takes: deterministic in ``raw``."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits)
    assert allowed.size, "a grammar mask allows nothing"
    return int(allowed[raw % allowed.size])


# fault(plan, phase) may raise to simulate a failure; phase: launch, complete or finalize.
Fault = Callable[[StepPlan, str], None]


@dataclass
class FakeRunner:
    """Records every launch; checks finalize order and that chains follow their parent."""

    num_pages: int = 1 << 12
    page_size: int = 16
    launched: list[StepPlan] = field(default_factory=list)
    fault: Fault | None = None
    words: int = words_for(VOCAB)
    completed_late: int = 0  # chained steps whose sampling waited for grammar masks
    resets: int = 0
    closed: bool = False  # (then nothing may launch)
    # The "model": a sampled token from the row's seed and the history before it.
    token_fn: Callable[[int, Sequence[int]], int] = fake_token
    draft: FakeDraft | None = None  # runs the plans' draft queries (engine/drafting.py)
    window: int = 0  # the window group's widest window and pages (0: none)
    window_pages: int = 0
    window_reads: int = 0  # sampled positions checked through the window pages
    # Launches that meet a new compiled shape, as a compiled runner's first step of a
    # shape does (the loop's step timing leaves them out: engine/spec_gain.py).
    shapes: int = 0
    host_thread_auto: bool = False  # (a test that wants the loop's automatic thread sets it)
    new_shape_fn: Callable[[StepPlan], bool] | None = None
    _unfinalized: list[FakeHandle] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots: list[int | None] = [None] * (self.num_pages * self.page_size)
        self.wslots: list[int | None] = [None] * (self.window_pages * self.page_size)

    def launch(
        self,
        plan: StepPlan,
        parent: FakeHandle | None,
        masks: np.ndarray | None = None,
        *,
        submit: bool = True,
    ) -> FakeHandle:
        if plan.chained:
            assert parent is not None and parent.plan.step_id == plan.parent_step
            assert parent in self._unfinalized, "chained on a finalized step"
            assert parent.submitted, "chained on a step held back"
            assert parent.tokens is not None, "chained on a step still waiting for masks"
        else:
            assert parent is None
            # No fresh step may launch while another is unfinalized.
            assert not self._unfinalized, "fresh launch with a step in flight"
        assert len(self._unfinalized) < 2, "more than two steps in flight"
        assert not self.closed, "launched after close"
        if self.fault is not None:
            self.fault(plan, "launch")
        self.launched.append(plan)
        self.shapes += self.new_shape_fn is not None and self.new_shape_fn(plan)
        p = self.page_size
        tokens: list[int] = [0] * plan.num_rows
        proposals: list[list[int]] = []
        draft_failed = False
        if plan.drafts:  # like the runner: a failed draft proposes placeholders
            assert self.draft is not None, "draft queries without a draft model"
            got = self.draft.propose(plan.drafts)
            draft_failed = got is None
            proposals = [[0] * q.k for q in plan.drafts] if got is None else got
        for seg in plan.segments:
            assert max(seg.pages, default=0) < self.num_pages, "a page outside the pool"
            assert seg.end <= len(seg.pages) * p, "a write past the page table"
            if seg.lazy:
                assert parent is not None and parent.tokens is not None and seg.num_tokens == 1
                inputs: Sequence[int] = (parent.tokens[seg.parent_row],)
            elif seg.draft >= 0:
                inputs = (seg.token_ids[0], *proposals[seg.draft])
                assert len(inputs) == seg.num_tokens
            else:
                inputs = seg.token_ids
                assert len(inputs) == seg.num_tokens
            for i, tok in enumerate(inputs):
                pos = seg.start + i
                self.slots[seg.pages[pos // p] * p + pos % p] = tok
                if self.window_pages:
                    page = seg.wpages[pos // p]
                    assert 0 <= page < self.window_pages, f"{seg.request_id}: window page {page}"
                    self.wslots[page * p + pos % p] = tok
            for i, pos in enumerate(seg.sample_positions):
                history = [self.slots[seg.pages[q // p] * p + q % p] for q in range(pos + 1)]
                assert None not in history, f"{seg.request_id} attends to unwritten KV"
                if self.window_pages:
                    lo = max(0, pos - self.window + 1)
                    seen = [self.wslots[seg.wpages[q // p] * p + q % p] for q in range(lo, pos + 1)]
                    assert seen == history[lo:], f"{seg.request_id}: its window reads wrong KV"
                    self.window_reads += 1
                seed = plan.sampling.seed[seg.sample_row + i]
                tokens[seg.sample_row + i] = self.token_fn(seed, history)  # type: ignore[arg-type]
        drafted = {
            q.request_id: tuple(t) for q, t in zip(plan.drafts, proposals, strict=True) if q.k
        }
        handle = FakeHandle(plan, None, raw=tuple(tokens), drafted=drafted or None)
        handle.draft_failed = draft_failed
        handle.submitted = submit
        assert submit or not (plan.sampling.constrained or plan.drafts), "held back, waits"
        self._unfinalized.append(handle)
        if plan.sampling.constrained and masks is None:
            assert plan.chained, "a fresh step knows its masks"
            return handle
        self._sample(handle, masks)
        return handle

    def complete(self, handle: FakeHandle, masks: np.ndarray) -> None:
        assert handle.tokens is None and handle in self._unfinalized
        assert self._unfinalized[0] is handle, "masks must wait for the parent's finalize"
        if self.fault is not None:
            self.fault(handle.plan, "complete")
        self.completed_late += 1
        self._sample(handle, masks)

    def _sample(self, handle: FakeHandle, masks: np.ndarray | None) -> None:
        tokens = list(handle.raw)
        rows = handle.plan.sampling.constrained
        assert (masks is None) == (not rows)
        for i, row in enumerate(rows):
            assert masks is not None
            tokens[row] = masked_token(tokens[row], masks[i])
        handle.tokens = tuple(tokens)

    def submit(self, handle: FakeHandle) -> None:
        assert not handle.submitted and handle in self._unfinalized, "submit of a sent step"
        if self.fault is not None:
            self.fault(handle.plan, "submit")
        handle.submitted = True

    def finalize(self, handle: FakeHandle) -> StepResult:
        assert handle.tokens is not None, "finalized before its masks were given"
        assert handle.submitted, "finalized a step never submitted"
        assert self._unfinalized and self._unfinalized[0] is handle, "finalize out of order"
        if self.fault is not None:
            self.fault(handle.plan, "finalize")
        self._unfinalized.pop(0)
        handle.finalized = True
        return StepResult(
            handle.plan.step_id,
            handle.tokens,
            drafted=handle.drafted,
            draft_failed=handle.draft_failed,
        )

    def close(self) -> None:
        assert not self._unfinalized, "closed with a step in flight"
        self.closed = True

    def reset(self) -> None:
        """Like the real runner after a failure: in-flight steps and all KV are gone."""
        self._unfinalized.clear()
        self.slots = [None] * (self.num_pages * self.page_size)
        self.wslots = [None] * (self.window_pages * self.page_size)
        self.resets += 1
        if self.draft is not None:
            self.draft.slots = [None] * len(self.draft.slots)


@dataclass
class FakeRecurrentRunner(FakeRunner):
    """A fake of a model with recurrent layers: besides the paged "KV", each state slot holds
    the tokens its sequence has consumed (a state is a fold over them). A segment reads its
    state from its hit's snapshot or its own slot (nothing at position 0), which must be
    exactly its history so far, keeps it in its backup slot (a verify), appends its inputs,
    copies the state to its snapshot slots at their positions and writes it back; a sample
    is checked against the pages too. A verify with per-position state ids holds the state
    after each of its positions under them (as runner/state.py does, outside the slots) until
    a plan releases the id; reading an id that holds nothing trips. So a
    snapshot at the wrong position, a stale or reused slot, or a state advanced by a step it
    was not in changes or trips the tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.states: dict[int, tuple[int, ...]] = {}
        self.snapshots_taken = 0
        self.snapshot_reads = 0
        self.backups_taken = 0
        self.replays = 0  # segments that read a verify's backup
        self.replay_snapshots = 0  # snapshots those kept
        self._backups: set[int] = set()
        self.held: dict[int, tuple[int, ...]] = {}  # per-position state ids
        self.resumes = 0  # segments that read one

    def launch(
        self,
        plan: StepPlan,
        parent: FakeHandle | None,
        masks: np.ndarray | None = None,
        *,
        submit: bool = True,
    ) -> FakeHandle:
        handle = super().launch(plan, parent, masks, submit=submit)
        p = self.page_size
        for slot in plan.released_states:
            assert self.held.pop(slot, None) is not None, f"id {slot} released, held nothing"
        for seg in plan.segments:
            assert seg.state_slot >= 0, "a recurrent row without a slot"
            if seg.start == 0:
                state: tuple[int, ...] = ()
            elif seg.state_src >= 0 and seg.state_src not in self.states:
                assert seg.state_src in self.held, f"{seg.request_id}: read of an empty id"
                state = self.held[seg.state_src]
                self.resumes += 1
            else:
                src = seg.state_src if seg.state_src >= 0 else seg.state_slot
                self.snapshot_reads += seg.state_src >= 0
                if seg.state_src in self._backups:  # a rolled-back verify's replay
                    self._backups.discard(seg.state_src)
                    self.replays += 1
                    self.replay_snapshots += len(seg.snapshots)
                state = self.states.get(src, ())
            assert len(state) == seg.start, f"{seg.request_id}: state at {len(state)}"
            history = [self.slots[seg.pages[q // p] * p + q % p] for q in range(seg.end)]
            assert state == tuple(history[: seg.start]), f"{seg.request_id}: state != its KV"
            if seg.state_backup >= 0:
                assert seg.num_samples > 1, "a backup for no verify"
                self.states[seg.state_backup] = state
                self.backups_taken += 1
                self._backups.add(seg.state_backup)
            state += tuple(history[seg.start :])  # type: ignore[arg-type]
            if seg.state_positions:
                assert seg.num_samples > 1 and seg.state_backup < 0, "positions of no verify"
                assert len(seg.state_positions) == seg.num_tokens - 1
            for j, slot in enumerate(seg.state_positions):
                assert slot not in self.states, f"id {slot} is a pool slot"
                self.held[slot] = state[: seg.start + j + 1]
            for pos, slot in seg.snapshots:
                assert seg.start < pos <= seg.end and pos % p == 0
                self.states[slot] = state[:pos]
                self.snapshots_taken += 1
                self._backups.discard(slot)
            self.states[seg.state_slot] = state
        return handle

    def reset(self) -> None:
        super().reset()
        self.states = {}
        self.held = {}


@dataclass
class FakeDraft:
    """A fake draft model (engine/drafting.py's Proposer) with its own token "KV" in pages
    of the target's page ids. It proposes what ``token_fn`` gives after the history it reads
    back through its pages, so with the target's ``token_fn`` it is a perfect draft: every
    proposal is accepted exactly when its KV is the request's true history, which makes
    acceptance a check on the scheduler's draft bookkeeping. ``seed_of``: a request's seed;
    ``fail_calls``: calls (counted from 1) that fail like a raising draft step."""

    num_pages: int
    page_size: int
    seed_of: Callable[[str], int]
    token_fn: Callable[[int, Sequence[int]], int] = fake_token
    max_tokens: int = 1 << 20
    fail_calls: frozenset[int] = frozenset()
    calls: int = 0
    fed: int = 0  # catch-up tokens fed
    resets: int = 0
    disabled: bool = False

    def __post_init__(self) -> None:
        self.slots: list[int | None] = [None] * (self.num_pages * self.page_size)

    def propose(self, queries) -> list[list[int]] | None:
        self.calls += 1
        if self.calls in self.fail_calls:
            self.slots = [None] * len(self.slots)
            self.resets += 1
            return None
        p = self.page_size
        out = []
        for q in queries:
            assert q.end + max(0, q.k - 1) <= len(q.pages) * p, "a draft write past the pages"
            assert sum(len(x.tokens) for x in queries) <= self.max_tokens
            self.fed += len(q.tokens)
            for i, tok in enumerate(q.tokens):
                pos = q.start + i
                self.slots[q.pages[pos // p] * p + pos % p] = tok
            proposal: list[int] = []
            for j in range(q.k):
                pos = q.end - 1 + j
                if j:  # the previous proposal is fed at the next position
                    self.slots[q.pages[pos // p] * p + pos % p] = proposal[-1]
                history = [self.slots[q.pages[i // p] * p + i % p] for i in range(pos + 1)]
                assert None not in history, f"{q.request_id}: the draft reads unwritten KV"
                proposal.append(self.token_fn(self.seed_of(q.request_id), history))  # type: ignore[arg-type]
            out.append(proposal)
        return out
