"""The scheduler: composes request state, admission, the KV manager and sampling rows into
step plans, and applies step results.

Pure Python; the runner only ever sees frozen ``StepPlan``s. Accounting (``num_computed``,
``num_inflight``) advances when a plan is *built*, so a step chained on an in-flight one is
accounted exactly like a fresh one (DESIGN §2, SGLang #30093).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tandem.engine import drafting, invariants, recovery, results, speculation, state_snapshots
from tandem.engine.admission import Admission
from tandem.engine.kv_manager import KVManager
from tandem.engine.plan import DraftQuery, Segment, StepPlan, StepResult
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_rows import row_sampling
from tandem.engine.spec_gain import SpecGain
from tandem.engine.speculation import SpecConfig
from tandem.engine.state_slots import state_managers
from tandem.outputs import EngineOutput

DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_model_len: int = 4096
    # Tokens per step: decode tokens and prefill chunks together.
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 0  # one request's prefill tokens per step (0: no extra limit)
    # Prefill tokens per step while any request is decoding (0: no extra limit). Smaller
    # chunks stall the streams for less per step, but more steps carry one.
    prefill_chunk_while_decoding: int = 0
    # The KV pool: kv_budget_tokens // page_size pages of page_size positions.
    kv_budget_tokens: int = 1 << 16
    page_size: int = DEFAULT_PAGE_SIZE
    prefix_cache: bool = True
    # Recurrent-state slots (models with recurrent layers: max_num_seqs; 0: none), and the
    # slots after them that keep snapshots of states for the prefix cache.
    state_slots: int = 0
    state_snapshots: int = 0
    speculation: SpecConfig = SpecConfig()
    state_positions: int = 0  # ids of verifies' states per position, after those slots
    # Sliding-window layers' own page group (engine/kv_manager.py): the widest window in
    # positions and the group's pages (0: no group; those layers use the full pages).
    window: int = 0
    window_pages: int = 0

    @property
    def num_pages(self) -> int:
        return max(1, self.kv_budget_tokens // self.page_size)


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up at first admission
    hit_tokens: int = 0  # of those, served from cache (shared pages)
    retractions: int = 0
    step_failures: int = 0  # steps that raised (their requests retried or failed)
    oom_recoveries: int = 0  # of those, out of device memory (the step budget shrank)
    spec_proposed: int = 0  # speculative tokens proposed and verified
    spec_accepted: int = 0  # of those, accepted
    spec_verifies: int = 0  # verify segments finalized


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.state_slots, snapshots, positions = state_managers(
            config.state_slots, config.state_snapshots, config.state_positions
        )
        self.kv = KVManager(
            config.num_pages,
            config.page_size,
            prefix_cache=config.prefix_cache,
            snapshots=snapshots,
            window=config.window,
            window_pages=config.window_pages,
            positions=positions,
        )
        if config.state_slots and config.speculation.enabled:
            assert self.kv.states is not None, "recurrent verifies need snapshot slots"
        self.stats = CacheStats()
        self.admission = Admission(
            self.kv, config.max_num_seqs, self.kv.tree is not None, self.stats
        )
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # holds pages (PREFILL, DECODE or FINISHED)
        self.max_step_tokens = config.max_num_batched_tokens  # shrinks after a device OOM
        self._good_steps = 0  # steps finalized since the budget last shrank or grew back
        self._step_id = 0
        self._admitted = 0
        self._pending: list[EngineOutput] = []  # outputs not tied to a step (aborts, errors)
        self._waiting_ids: set[str] = set()
        self.proposer: drafting.Proposer | None = None  # the draft model, set by the engine
        self.acceptance = speculation.Acceptance()  # of recent verifies, engine-wide
        self.gain = SpecGain(config.speculation.min_gain)  # speculating vs plain steps' speed

    # ---- intake -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        n = request.num_prompt_tokens
        cfg = self.config
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        if request.max_len > cfg.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) = "
                f"{request.max_len} exceeds the context length {cfg.max_model_len}"
            )
        if not self._fits_alone(request):
            raise ValueError(
                f"request needs {request.max_len} KV tokens, which cannot fit the KV pool "
                f"({self.kv.num_pages * cfg.page_size} tokens) even alone"
            )
        if request.request_id in self.running or request.request_id in self._waiting_ids:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if cfg.speculation.enabled:
            request.spec = speculation.new_state(cfg.speculation, self.acceptance)
        self.waiting.append(request)
        self._waiting_ids.add(request.request_id)

    def _fits_alone(self, req: Request) -> bool:
        return self.kv.pages_for(req.max_len) <= self.kv.num_pages

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its pages are freed once no in-flight step references them."""
        if request_id in self._waiting_ids:
            req = next(r for r in self.waiting if r.request_id == request_id)
            self._unqueue(req)
            self.finish(req, "abort")
            return True
        req = self.running.get(request_id)
        if req is None or req.finished:
            return False
        self.finish(req, "abort")
        self.maybe_release(req)
        return True

    def _unqueue(self, req: Request) -> None:
        self.waiting.remove(req)
        self._waiting_ids.discard(req.request_id)
        self.admission.blocked = False

    # ---- queries ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def kv_usage(self) -> float:
        """Share of the pool live requests hold (cached pages are reclaimable)."""
        return self.kv.num_held / self.kv.num_pages

    def take_pending_outputs(self) -> list[EngineOutput]:
        out, self._pending = self._pending, []
        return out

    # ---- planning -----------------------------------------------------------------------
    def schedule(self, parent: StepPlan | None = None) -> StepPlan | None:
        """The next step. ``parent``: the one step still in flight (its sampled tokens feed
        this step's lazy segments), or None when nothing is in flight. Returns None when
        there is nothing to run, or — with a parent — when the step needs something only a
        finalized parent allows: retracting a request to free pages."""
        kv = self.kv
        if parent is None:
            recovery.fit(self)  # KV pressure: retract the latest admitted
        lazy = {rid: row for row, rid in enumerate(parent.sample_request_ids)} if parent else {}
        budget = self.max_step_tokens
        decodes: list[tuple[Request, int]] = []  # (request, parent row or -1)
        proposals: dict[str, list[int]] = {}  # speculating requests' proposed tokens
        speculate = speculation.speculating(self)
        spec_mode = speculate and speculation.anyone_speculating(self)  # (steps unchained)
        if spec_mode and parent is not None:
            # A speculating request cannot join a chained step, and letting the others run
            # on without it would give it every other step: the loop runs one step at a time
            # while anyone speculates (a verify yields more than the overlap saves).
            return None
        need = wneed = 0  # pages the decodes need (and of the window group)
        for req in self.running.values():
            if req.status is not RequestStatus.DECODE or len(decodes) >= budget:
                continue
            if req.spec_inflight:
                continue  # its verify is in flight: it joins the step after
            if len(req.output_token_ids) + req.num_pending_samples >= req.params.max_tokens:
                continue  # its last token is in flight: don't waste a step
            spec = speculate and req.spec is not None and req.spec.active
            if req.num_computed == req.num_tokens:
                if spec:
                    continue  # it speculates next, from its tokens on the host: sits out
                decodes.append((req, lazy[req.request_id]))  # its input is still on the device
            else:
                assert req.num_computed == req.num_tokens - 1
                decodes.append((req, -1))
                if spec:
                    proposals[req.request_id] = speculation.propose(req, self.config.speculation)
            need += req.num_computed // kv.page_size >= len(req.pages)
            if kv.walloc is not None:
                wneed += kv.window_need(req, req.num_computed + 1)
        if need > kv.available() or wneed > kv.window_available():
            assert parent is not None, "recovery.fit left the decodes short of pages"
            return None
        proposals = speculation.fit_proposals(self, decodes, proposals, budget, need, wneed)
        if kv.states is not None:
            proposals = speculation.back_up(self, proposals)
        if proposals:
            need += speculation.extra_pages(kv, decodes, proposals)
        # New requests: pages for their known tokens, keeping the decodes' pages in reserve
        # (and with a window group, every running request's window room).
        wreserve = 0
        if kv.walloc is not None:
            # Each running request's next window pages (a decode's with its proposals), or
            # what it still takes to hold a steady window, whichever is more.
            wreserve = sum(
                max(
                    kv.window_need(r, r.num_computed + 1 + len(proposals.get(r.request_id, ()))),
                    kv.window_commitment(r),
                )
                for r in self.running.values()
                if not r.finished
            )
        admitted = self.admission.admit(
            self.waiting, len(self.running), need, self._leader_prefilling, wreserve
        )
        # (Later admissions are retracted first; a head others passed counts as before them.)
        for req in sorted(admitted, key=lambda r: r.num_passed == 0):
            self._admitted += 1
            req.admit_order = self._admitted
        for req in admitted:
            self._waiting_ids.discard(req.request_id)
            if self.state_slots is not None:
                req.state_slot = self.state_slots.allocate()
            self.running[req.request_id] = req
        decodes.sort(key=lambda d: (d[1] < 0, d[1]))  # lazy ones first, in the parent's order
        proposals, drafts = drafting.allocate(self, decodes, proposals)
        draft_of = {q.request_id: i for i, q in enumerate(drafts) if q.k}
        budget -= len(decodes) + sum(len(p) for p in proposals.values())
        segments: list[Segment] = []
        sampled: list[Request] = []
        # No windows, no recurrent states (slots, snapshots, a verify's backups).
        plain = kv.walloc is None and self.state_slots is None and kv.states is None
        running = self.running.values()
        for req, prow in decodes:
            pos = req.num_computed
            proposal = proposals.get(req.request_id, [])
            n = 1 + len(proposal)
            if req.spec_backup >= 0 or req.spec_positions:  # (its draft may have come
                speculation.fit_slots(kv, req, n)  # back shorter than its slots)
            tokens = () if prow >= 0 else (req.token_at(pos), *proposal)
            seg = Segment(req.request_id, pos, n, tokens, tuple(req.pages), prow, len(sampled))
            if not plain or proposal:  # (the defaults' fields set only where they may differ)
                seg.wpages, seg.num_samples = tuple(req.wpages), n
                seg.draft = draft_of.get(req.request_id, -1)
                seg.state_slot, seg.state_src = req.state_slot, req.state_src
                seg.state_backup, seg.state_positions = req.spec_backup, req.spec_positions
                if kv.snapshots is not None:
                    seg.snapshots = state_snapshots.checkpoint(kv, running, req, pos + 1)
            segments.append(seg)
            sampled += [req] * n
            req.spec_inflight = bool(proposal)
        if self.config.prefill_chunk_while_decoding and decodes:
            budget = min(budget, self.config.prefill_chunk_while_decoding)
        chunks: list[Segment] = []
        cap = recovery.prefill_cap(self)
        for req in self.running.values():
            if req.status is not RequestStatus.PREFILL or budget <= 0:
                continue
            seg = self._chunk(req, min(budget, cap), len(sampled))
            if seg is None:
                continue  # no window pages for it this step
            budget -= seg.num_tokens
            chunks.append(seg)
            if seg.sample_row >= 0:
                sampled.append(req)
        segments += chunks
        if not segments:
            return None
        return self._launch(parent, segments, sampled, chunks, drafts, spec_mode)

    def _chunk(self, req: Request, budget: int, row: int) -> Segment | None:
        """The next prefill chunk of ``req``; it samples when it reaches the last known token
        (then the request decodes: routed by state, a last chunk may be one token). None
        when the window group has no page for it this step."""
        kv = self.kv
        start = req.num_computed
        tokens = req.token_ids()
        end = min(len(tokens), start + budget)
        if kv.walloc is not None:  # as far as the window pages there are reach
            end = min(end, (len(req.wpages) + kv.window_available()) * kv.page_size)
            if end <= start:
                return None
        snaps: tuple[tuple[int, int], ...] = ()
        if self.kv.snapshots is not None and not req.replaying:
            # (A replay's states are mid-output: not worth a cached prefix's slot.)
            end, snaps = state_snapshots.for_chunk(self.kv, req, tokens, start, end)
        kv.grow_window(req, end)
        sample = end == len(tokens)
        k = req.params.prompt_logprobs
        # Until the first output is reported the prompt's entries are still owed (a
        # retraction before then dropped the partial list; see recovery.retract).
        scored_end = min(end, req.num_prompt_tokens - 1)
        want = k is not None and not req.cache_reported and scored_end > start
        return Segment(
            req.request_id,
            start,
            end - start,
            tuple(tokens[start:end]),
            tuple(req.pages),
            sample_row=row if sample else -1,
            wpages=tuple(req.wpages),
            logprobs=k if want and k is not None else -1,
            next_tokens=tuple(tokens[start + 1 : scored_end + 1]) if want else (),
            state_slot=req.state_slot,
            state_src=req.state_src,
            snapshots=snaps,
        )

    def _launch(
        self,
        parent: StepPlan | None,
        segments: list[Segment],
        sampled: list[Request],
        chunks: list[Segment],
        drafts: list[DraftQuery],
        spec_mode: bool = False,
    ) -> StepPlan:
        """Freeze a plan and advance accounting for every request it touches."""
        released = self.kv.positions.take_freed() if self.kv.positions else ()
        self.gain.planned(self._step_id + 1, segments, chunks, self.running, spec_mode, drafts)
        positions: list[int] = []  # the sampled positions, in row order
        all_lazy, verifies = True, False  # every sampled segment lazy; any verify segment
        for seg in segments:
            req = self.running[seg.request_id]
            req.num_computed += seg.num_tokens
            req.num_inflight += 1
            if seg.state_src >= 0:  # read by this step: the request's own slot from now on
                self.kv.drop_snapshot(req.state_src)
                req.state_src = -1
            if seg.sample_row >= 0:
                req.num_pending_samples += seg.num_samples
                req.status = RequestStatus.DECODE
                req.replaying = False
                all_lazy = all_lazy and seg.parent_row >= 0
                if seg.num_samples == 1:
                    positions.append(seg.start + seg.num_tokens - 1)  # (seg.sample_positions)
                else:
                    positions += seg.sample_positions
                    verifies = True
            assert req.num_computed <= len(req.pages) * self.kv.page_size
        for seg in chunks:
            # Launched prefill is visible to later steps' hits (the device runs steps in
            # order), never to this one's.
            req = self.running[seg.request_id]
            tokens = req.token_ids()
            self.kv.cache(req, tokens, seg.end)
            for pos, slot in seg.snapshots:
                self.kv.keep_snapshot(tokens, pos, slot)
        ids = tuple(r.request_id for r in sampled)
        drafted = speculation.drafted_rows(segments) if verifies else {}
        reuse = parent is not None and ids == parent.sample_request_ids and all_lazy
        self._step_id += 1
        return StepPlan(
            step_id=self._step_id,
            segments=tuple(segments),
            sample_request_ids=ids,
            sample_positions=tuple(positions),
            sampling=parent.sampling if reuse and parent else row_sampling(sampled, drafted),
            parent_step=parent.step_id if parent is not None else 0,
            reuse_sampling=reuse,
            drafts=tuple(drafts),
            released_states=released,
        )

    def _leader_prefilling(self, req: Request) -> bool:
        if req.follows is None:
            return False
        leader = self.running.get(req.follows)
        if leader is not None:
            return leader.status is RequestStatus.PREFILL
        return req.follows in self._waiting_ids

    # ---- failures (engine/recovery.py) -------------------------------------------------
    def recover(self, failed: Iterable[str], error: str | None, *, oom: bool) -> None:
        """The runner lost every in-flight step and its KV: see ``recovery.recover``."""
        recovery.recover(self, failed, error, oom=oom)

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        """Apply a finalized step (strictly in launch order): append tokens, detect stops."""
        return results.apply(self, plan, result)

    def grammar_masks(self, plan: StepPlan, words: int) -> np.ndarray | None:
        """Allowed-token bitmasks of the plan's constrained rows (see results.grammar_masks)."""
        return results.grammar_masks(self, plan, words)

    def finish(self, req: Request, reason: str, *, emit: bool = True) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if emit:
            self._pending.append(EngineOutput(req.request_id, (), reason))

    def maybe_release(self, req: Request, *, cache: bool = True) -> None:
        """Late release: a finished request keeps its pages until no launched step uses
        them. With the prefix cache its whole written pages (every position certainly
        written with the token the tree will claim for it) then stay behind as cached."""
        if not (req.finished and req.num_inflight == 0 and req.request_id in self.running):
            return
        self.admission.blocked = False
        if cache:
            self._cache(req)
        self._release(req)
        del self.running[req.request_id]

    def _release(self, req: Request) -> None:
        self.kv.release(req)
        if req.spec is not None:
            req.spec.draft_len = 0  # its next pages may hold anything
        self.kv.drop_snapshot(req.state_src)
        self.kv.drop_snapshot(req.checkpoint)
        speculation.fit_slots(self.kv, req, 0)
        req.state_src = req.checkpoint = -1
        req.replaying = False
        req.checkpoint_pos = 0
        req.snap_targets.clear()
        if req.state_slot >= 0:
            assert self.state_slots is not None
            self.state_slots.release(req.state_slot)
            req.state_slot = -1

    def _cache(self, req: Request) -> None:
        """Offer every whole page certainly written with the token the tree will claim."""
        length = min(req.num_computed, req.num_tokens)
        tokens = req.token_ids()
        cached = self.kv.cache(req, tokens, length)
        if req.checkpoint >= 0 and 0 < req.checkpoint_pos <= cached:
            # Its state there (a multi-turn chat's next turn resumes from it).
            self.kv.keep_snapshot(tokens, req.checkpoint_pos, req.checkpoint)
            req.checkpoint = -1

    # ---- invariants ---------------------------------------------------------------------
    def check_invariants(self, inflight: Iterable[StepPlan] = ()) -> None:
        invariants.check(self, list(inflight))
