"""The scheduler: owns request state, admission, step plans and their accounting.

Pure Python; the runner only ever sees frozen ``StepPlan``s. Accounting (``num_computed``,
``num_inflight``) advances when a plan is *built*, so a chained step is accounted exactly like
a fresh one (DESIGN §2, SGLang #30093).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tandem.engine.grammar import Matcher, accept_all, fill_masks
from tandem.engine.plan import PrefillChunk, RowCopy, RowSampling, StepPlan, StepResult
from tandem.engine.radix import Match, Node, RadixTree
from tandem.engine.request import Request, RequestStatus
from tandem.engine.rows import RowAllocator
from tandem.outputs import EngineOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    # Prefill tokens per step while any request is decoding (0: no extra limit). Smaller
    # chunks stall the streams for less per step, but more steps carry one: on the H200 512
    # raised both the ITL median and p99 and the long prompts' TTFT (docs/benchmarks.md).
    prefill_chunk_while_decoding: int = 0
    # Bound on the KV the runner holds: rows (rounded up to row_chunk) x row capacity.
    kv_budget_tokens: int = 1 << 20
    capacity_chunk: int = 256
    row_chunk: int = 8
    prefix_cache: bool = True
    # Rows in the pool (running + cached); 0: max_num_seqs, twice that with the prefix cache.
    num_rows: int = 0

    @property
    def total_rows(self) -> int:
        if self.num_rows:
            return max(self.num_rows, self.max_num_seqs)
        return self.max_num_seqs * (2 if self.prefix_cache else 1)


def round_up(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up at first admission
    hit_tokens: int = 0  # of those, served from cache
    copied_tokens: int = 0  # hits served by a device copy (the rest reuse a row in place)
    moved_tokens: int = 0  # cached KV moved out of the way of the decode batch
    retractions: int = 0
    evictions: int = 0
    kv_oom_recoveries: int = 0  # KV growths the device refused (budget shrunk each time)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.rows = RowAllocator(config.total_rows)
        self.tree = RadixTree()
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # owns a row (PREFILL, DECODE or FINISHED)
        self.capacity = 0  # row capacity granted to the runner (only grows, like its buffers)
        self.stats = CacheStats()
        self._step_id = 0
        self._pending: list[EngineOutput] = []  # outputs not tied to a step (aborts)
        self._copies: list[RowCopy] = []
        self._blocked = False  # the queue head waits for rows or KV budget
        self._waiting_ids: set[str] = set()

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
                f"request needs {request.max_len} KV tokens, which cannot fit the KV budget "
                f"({cfg.kv_budget_tokens} tokens) even alone"
            )
        if request.request_id in self.running or request.request_id in self._waiting_ids:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.waiting.append(request)
        self._waiting_ids.add(request.request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its row is freed once no in-flight step references it."""
        for req in self.waiting if request_id in self._waiting_ids else ():
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._waiting_ids.discard(request_id)
                self._blocked = False
                self._finish(req, "abort")
                return True
        req = self.running.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        self._maybe_release(req)
        return True

    # ---- queries ------------------------------------------------------------------------
    def needs_prefill(self) -> bool:
        """Whether a fresh step has work a chained one cannot do: a prefilling request, or a
        queued one that could be admitted now (a queue blocked on rows or KV budget does not
        break chains; a release, abort or retraction unblocks it)."""
        admissible = (
            bool(self.waiting)
            and not self._blocked
            and len(self.running) < self.config.max_num_seqs
        )
        return admissible or any(r.status is RequestStatus.PREFILL for r in self.running.values())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def kv_usage(self) -> float:
        """Share of the KV budget live requests hold (cached rows are reclaimable, so they
        do not count)."""
        used = self.rows.num_owned * self.capacity
        return min(1.0, used / self.config.kv_budget_tokens)

    def _memory(self, span: int, capacity: int) -> int:
        """KV tokens the runner's buffers take for ``span`` rows of ``capacity`` positions."""
        cfg = self.config
        return min(round_up(span, cfg.row_chunk), cfg.total_rows) * capacity

    def _need(self, req: Request) -> int:
        """Positions to grant a request: its tokens plus a chunk of headroom (so a chain
        rarely has to break for growth), never more than it can ever use."""
        return min(req.max_len, req.num_tokens + self.config.capacity_chunk)

    def _capacity_for(self, reqs: Iterable[Request]) -> int:
        need = max((self._need(r) for r in reqs), default=0)
        return max(self.capacity, round_up(need, self.config.capacity_chunk))

    def take_pending_outputs(self) -> list[EngineOutput]:
        out, self._pending = self._pending, []
        return out

    # ---- planning -----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """A fresh step: fit the KV budget (retracting if it must), admissions, prefill
        chunks under the token budget, all decodes. Nothing is in flight when it runs."""
        self._fit()
        self._admit()
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        if cfg.prefill_chunk_while_decoding and any(
            r.status is RequestStatus.DECODE for r in self.running.values()
        ):
            budget = min(budget, cfg.prefill_chunk_while_decoding)
        chunks: list[PrefillChunk] = []
        for req in self.running.values():
            if req.status is not RequestStatus.PREFILL:
                continue
            target = req.num_tokens - 1
            if req.num_computed < target and budget > 0:
                end = min(target, req.num_computed + budget)
                tokens = req.token_ids()
                chunk = tuple(tokens[req.num_computed : end])
                k = req.params.prompt_logprobs
                # Until the first output is reported the prompt's entries are still owed (a
                # retraction before then dropped the partial list; see _retract).
                want = k is not None and not req.cache_reported
                chunks.append(
                    PrefillChunk(
                        req.request_id,
                        req.row,
                        req.num_computed,
                        chunk,
                        logprobs=k if want and k is not None else -1,
                        next_token=tokens[end],
                    )
                )
                budget -= len(chunk)
                req.num_computed = end
            if req.num_computed == target and budget > 0:
                # Route by state: the last token is an ordinary decode row.
                req.status = RequestStatus.DECODE
                budget -= 1
        num_rows = self.rows.high_water
        if num_rows == 0 and not chunks:
            assert not self._copies
            return None
        ids: list[str | None] = [None] * num_rows
        positions = [0] * num_rows
        tokens_in = [0] * num_rows
        reqs: list[Request | None] = [None] * num_rows
        for req in self.running.values():
            assert req.row is not None and not req.finished
            if req.status is RequestStatus.DECODE:
                ids[req.row] = req.request_id
                tokens_in[req.row] = req.last_token
                reqs[req.row] = req
            # Prefilling rows are holes placed at their next unwritten position.
            positions[req.row] = req.num_computed
        for row in self.rows.cached:
            if row < num_rows:  # a cached hole writes past what the tree claims
                positions[row] = self.tree.row_length(row)
        plan = self._launch(ids, positions, tuple(tokens_in), reqs, tuple(chunks), chained=False)
        if self.config.prefix_cache:
            # Launched prefill is visible to later steps' hits (the device runs steps in
            # order), never to this one's: its copies run before its chunks.
            for c in chunks:
                req = self.running[c.request_id]
                self.tree.insert(req.token_ids()[: c.start + len(c.token_ids)], c.row)
        return plan

    def chain(self, parent: StepPlan) -> StepPlan | None:
        """A decode step on the parent's lazy tokens, or None when the chain must break."""
        if not parent.is_decode or self.needs_prefill():
            return None
        reqs: list[Request | None] = []
        for rid in parent.row_request_ids:
            req = self.running.get(rid) if rid is not None else None
            if rid is not None:
                if req is None or req.finished:
                    return None  # a row would have to be dropped
                # The parent's token is certainly this request's last one: don't waste a step.
                if len(req.output_token_ids) + req.num_inflight >= req.params.max_tokens:
                    return None
            reqs.append(req)
        # Live rows advance; holes stay where they are (a rewrite of an unclaimed position).
        positions = [
            p + 1 if rid is not None else p
            for p, rid in zip(parent.positions, parent.row_request_ids, strict=True)
        ]
        if max(positions) >= self.capacity:
            return None  # rows must grow: a scheduling decision (budget, retraction)
        return self._launch(
            list(parent.row_request_ids),
            positions,
            None,
            reqs,
            (),
            chained=True,
            sampling=parent.sampling,
        )

    def _launch(
        self,
        ids: list[str | None],
        positions: list[int],
        tokens: tuple[int, ...] | None,
        reqs: list[Request | None],
        chunks: tuple[PrefillChunk, ...],
        *,
        chained: bool,
        sampling: RowSampling | None = None,
    ) -> StepPlan:
        """Freeze a plan and advance accounting for every request it touches."""
        for req in reqs:
            if req is not None:
                req.num_computed += 1
        touched = {r.request_id for r in reqs if r is not None}
        touched.update(c.request_id for c in chunks)
        for rid in touched:
            self.running[rid].num_inflight += 1
        ends = [p + 1 for p in positions] + [c.start + len(c.token_ids) for c in chunks]
        assert max(ends) <= self.capacity, "a step outgrew the granted capacity"
        copies, self._copies = tuple(self._copies), []
        self._step_id += 1
        return StepPlan(
            step_id=self._step_id,
            row_request_ids=tuple(ids),
            positions=tuple(positions),
            input_tokens=tokens,
            sampling=sampling or _row_sampling(reqs),
            chunks=chunks,
            capacity=self.capacity,
            chained=chained,
            copies=copies,
            kv_rows=self.rows.span,
        )

    # ---- KV budget: fitting, admission, retraction ---------------------------------------
    def _fit(self) -> None:
        """Grow the granted capacity for the running requests; while that overflows the
        budget, free the topmost row (evict it if cached, else retract its request)."""
        budget = self.config.kv_budget_tokens
        while True:
            live = [r for r in self.running.values() if not r.finished]
            cap = self._capacity_for(live)
            if self._memory(self.rows.span, cap) <= budget or self.rows.span == 0:
                break
            top = self.rows.span - 1
            if top in self.rows.cached:
                self._evict(top)
            else:
                rid = self.rows.owner(top)
                assert rid is not None
                self._retract(self.running[rid])
        self._grant(cap, self.rows.span)

    def _grant(self, cap: int, span: int) -> None:
        """Raise the capacity to at least ``cap``. Growth reallocates every row the pool
        keeps, so it grows geometrically (at most doubling, within the context length and
        the budget): a long generation costs a few reallocations, not one per chunk."""
        if cap <= self.capacity:
            return
        cfg = self.config
        doubled = min(2 * self.capacity, round_up(cfg.max_model_len, cfg.capacity_chunk))
        if doubled > cap and self._memory(span, doubled) <= cfg.kv_budget_tokens:
            cap = doubled
        self.capacity = cap

    def _admit(self) -> None:
        cfg = self.config
        self._blocked = False
        # Prompts admitted in this step: their KV is not written yet, so a request sharing a
        # long prefix with one of them waits a step and then hits instead of recomputing.
        batch = RadixTree()
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if cfg.prefix_cache and self._leader_prefilling(req):
                break  # its prompt's KV is about to be in the cache
            tokens = req.token_ids()
            # Prompt log-probabilities need every prompt position computed: no reuse.
            reuse = cfg.prefix_cache and req.params.prompt_logprobs is None
            match = self.tree.match(tokens, len(tokens) - 1) if reuse else None
            hit = match.length if match is not None else 0
            waits = match is not None and batch.match(tokens, len(tokens) - 1).length >= (
                hit + cfg.capacity_chunk
            )
            if waits:
                break
            row, adopt, move_to = self._pick_row(match)
            if row is None:
                self._blocked = True
                break  # every row is owned
            live = [r for r in self.running.values() if not r.finished] + [req]
            cap = self._capacity_for(live)
            span = max(self.rows.span, row + 1, (move_to or 0) + 1)
            if move_to is not None and self._memory(span, cap) > cfg.kv_budget_tokens:
                move_to = None  # no room to keep the cached KV in the way: evict it instead
                span = max(self.rows.span, row + 1)
            if self._memory(span, cap) > cfg.kv_budget_tokens:
                top = self._evictable_top(exclude=row if adopt else None)
                if top is None:
                    self._blocked = True
                    break  # wait for running requests to finish
                self._evict(top)
                continue
            self.waiting.popleft()
            self._waiting_ids.discard(req.request_id)
            if req.num_retractions == 0:
                self.stats.queried_tokens += req.num_prompt_tokens
                self.stats.hit_tokens += hit
            if not req.cache_reported:  # what the client will be told: this admission's hit
                req.num_cached_tokens = hit
            if adopt:
                self.rows.adopt(row, req.request_id)
                self.tree.truncate(row, hit)
            else:
                if move_to is not None:  # keep the cached KV, out of the decode batch
                    self._copies.append(RowCopy(row, move_to, self.tree.row_length(row)))
                    self.tree.rename(row, move_to)
                    self.rows.move_cached(row, move_to)
                    self.stats.moved_tokens += self._copies[-1].length
                elif row in self.rows.cached:
                    self._evict(row)
                taken = self.rows.allocate(req.request_id)
                assert taken == row
                if hit:
                    assert match is not None
                    src = self.tree.lru(match.rows)
                    assert src is not None
                    self._copies.append(RowCopy(src, row, hit))
                    self.stats.copied_tokens += hit
                    self.tree.add_row(match, row)
            if hit:
                assert match is not None
                self.tree.lock(match.node)
                req.lock_node = match.node
                self.tree.touch(row)
            req.row = row
            req.status = RequestStatus.PREFILL
            req.num_computed = hit
            self.running[req.request_id] = req
            self._grant(cap, self.rows.span)
            if match is not None:
                batch.insert(tokens, len(batch.row_tail))

    def _leader_prefilling(self, req: Request) -> bool:
        if req.follows is None:
            return False
        leader = self.running.get(req.follows)
        if leader is not None:
            return leader.status is RequestStatus.PREFILL
        return req.follows in self._waiting_ids

    def _pick_row(self, match: Match | None) -> tuple[int | None, bool, int | None]:
        """The row for a request: (row, adopt, move_to). The decode batch spans rows 0 to
        the highest owned one, so a request takes the lowest row that is free or cached,
        keeping that batch dense. A hit adopts a cached row holding its prefix when that
        row is no higher (zero copy). Cached KV in the way moves to the lowest free row above
        the batch (one copy) when there is one, and is evicted otherwise."""
        free = self.rows.peek()
        cached = self.rows.cached
        lowest_cached = min(cached, default=None)
        if lowest_cached is not None and (free is None or lowest_cached < free):
            row = lowest_cached
        else:
            row = free
        if row is None:
            return None, False, None
        if match is not None and match.length:
            limit = max(row, self.rows.high_water - 1)
            holders = {r for r in match.rows if r in cached and r <= limit}
            if holders:
                return self.tree.lru(holders), True, None
        if row in cached:
            above = self.rows.lowest_free_above(max(row, self.rows.high_water - 1))
            if above is not None:
                return row, False, above
        return row, False, None

    def _evictable_top(self, exclude: int | None) -> int | None:
        """The topmost cached row above every owned row (evicting it shrinks the pool) that
        no copy planned for this step still has to read."""
        hw = self.rows.high_water
        sources = {c.src for c in self._copies}
        above = [r for r in self.rows.cached if r >= hw and r != exclude and r not in sources]
        return max(above, default=None)

    def _evict(self, row: int) -> None:
        self.tree.remove(row)
        self.rows.evict(row)
        self.stats.evictions += 1

    def _retract(self, req: Request) -> None:
        """Give a running request's row back and queue it first; it resumes by prefilling its
        prompt and output so far (from cache where the tree still has them)."""
        assert req.num_inflight == 0 and req.row is not None
        self._unlock(req)
        self.tree.remove(req.row)
        self.rows.release(req.row, req.request_id)
        req.row = None
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.num_retractions += 1
        # A resumed sample of n > 1 must not wait for its leader: the leader may be queued
        # behind it now, and its prompt KV may be gone anyway.
        req.follows = None
        if not req.cache_reported:
            req.prompt_logprobs = None  # recomputed in full by the re-prefill
        self.stats.retractions += 1
        del self.running[req.request_id]
        self.waiting.appendleft(req)
        self._waiting_ids.add(req.request_id)

    def recover_from_kv_oom(self, plan: StepPlan, held: int, wanted: int) -> None:
        """A fresh step's KV growth failed on the device (the runner emptied its pool): undo
        the step's launch accounting, retract every running request (each resumes by
        prefill, in its old order), drop the prefix cache, and shrink the budget below the
        failed size (never below what the pool held before)."""
        for rid in plan.request_ids:
            self.running[rid].num_inflight -= 1
        for req in reversed(list(self.running.values())):
            if req.finished:
                self._maybe_release(req)
            else:
                self._retract(req)
        for row in sorted(self.rows.cached):
            self._evict(row)
        self._copies = []
        self.capacity = 0
        budget = max(held, min(self.config.kv_budget_tokens, wanted) * 3 // 4, 1)
        self.config = cfg = dataclasses.replace(self.config, kv_budget_tokens=budget)
        self.stats.kv_oom_recoveries += 1
        # Requests the smaller budget can never hold fail now instead of waiting forever.
        for req in list(self.waiting):
            if not self._fits_alone(req):
                self.waiting.remove(req)
                self._waiting_ids.discard(req.request_id)
                self._finish(req, "error", emit=False)
                self._pending.append(
                    EngineOutput(
                        req.request_id,
                        (),
                        "error",
                        error=f"out of device memory: the KV budget is now "
                        f"{cfg.kv_budget_tokens} tokens, this request needs {req.max_len}",
                        error_kind="resource",
                    )
                )

    def _fits_alone(self, req: Request) -> bool:
        """Whether the KV budget could hold this request with nothing else running."""
        cfg = self.config
        return self._memory(1, round_up(req.max_len, cfg.capacity_chunk)) <= cfg.kv_budget_tokens

    def _unlock(self, req: Request) -> None:
        if req.lock_node is not None:
            assert isinstance(req.lock_node, Node)
            self.tree.unlock(req.lock_node)
            req.lock_node = None

    # ---- results ------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[EngineOutput]:
        """Apply a finalized step (strictly in launch order): append tokens, detect stops."""
        assert result.step_id == plan.step_id
        outputs = self.take_pending_outputs()
        for rid, entries in (result.prompt_logprobs or {}).items():
            req = self.running[rid]
            req.prompt_logprobs = (req.prompt_logprobs or []) + entries
        # Grammar rows consume their tokens first, together (llguidance's threads for many);
        # a stop token is an end, not grammar text.
        accepted: dict[int, bool] = {}
        if plan.sampling.constrained:
            guided = []
            for row in plan.sampling.constrained:
                req = self.running[plan.row_request_ids[row]]  # type: ignore[index]
                token = result.tokens[row]
                if not req.finished and token not in req.stop_ids:
                    guided.append((row, req.grammar, token))
            verdicts = accept_all([(g, t) for _, g, t in guided])
            accepted = {row: ok for (row, _, _), ok in zip(guided, verdicts, strict=True)}
        for row, (rid, token) in enumerate(zip(plan.row_request_ids, result.tokens, strict=True)):
            if rid is None:
                continue
            req = self.running[rid]
            if req.finished:
                continue  # finished earlier in the chain; this token is past its end
            if req.grammar is not None and not accepted.get(row, True):
                # Masks make this impossible; if it happens the request fails alone.
                error = f"grammar rejected token {token}: {req.grammar.error or 'not allowed'}"
                self._finish(req, "error", emit=False)
                outputs.append(EngineOutput(rid, (), "error", error=error, error_kind="internal"))
                continue
            req.output_token_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is None and req.grammar is not None and req.grammar.done:
                reason = "stop"  # the grammar is complete: nothing but the end may follow
            if reason is not None:
                self._finish(req, reason, emit=False)
            cached = prompt_lps = None
            if not req.cache_reported:
                req.cache_reported = True
                cached = req.num_cached_tokens
                prompt_lps, req.prompt_logprobs = req.prompt_logprobs, None
            lp = result.logprobs.get(row) if result.logprobs else None
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
        for rid in plan.request_ids:
            req = self.running[rid]
            req.num_inflight -= 1
            self._maybe_release(req)
        return outputs

    def grammar_masks(self, plan: StepPlan, words: int) -> np.ndarray | None:
        """Allowed-token bitmasks (int32, ``words`` per row) of the plan's constrained rows,
        from each request's grammar after all its finalized tokens. Call it when the step
        before ``plan`` is finalized (for a chained plan: after its parent)."""
        rows = plan.sampling.constrained
        if not rows:
            return None
        masks = np.full((len(rows), words), -1, dtype=np.int32)
        matchers: list[Matcher | None] = []
        for row in rows:
            rid = plan.row_request_ids[row]
            req = self.running.get(rid) if rid is not None else None
            if req is not None and not req.finished and req.grammar is not None:
                assert req.grammar.consumed == len(req.output_token_ids), "mask computed early"
                matchers.append(req.grammar)
            else:
                matchers.append(None)  # finished in the chain: its token is discarded
        fill_masks(matchers, masks)
        bits = masks.view(np.uint32)
        for i, m in enumerate(matchers):
            if m is None or m.eos is None or not bits[i, m.eos >> 5] >> (m.eos & 31) & 1:
                continue
            # Where the grammar may end, so may the request's own stop tokens.
            req = self.running[plan.row_request_ids[rows[i]]]  # type: ignore[index]
            for t in req.stop_ids:
                if t < words * 32:
                    bits[i, t >> 5] |= np.uint32(1 << (t & 31))
        return masks

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_ids:
            return "stop"
        if len(req.output_token_ids) >= req.params.max_tokens:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, *, emit: bool = True) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if emit:
            self._pending.append(EngineOutput(req.request_id, (), reason))

    def _maybe_release(self, req: Request) -> None:
        """Late release: a finished request keeps its row until no launched step uses it.
        With the prefix cache its KV (every position certainly written with the token the
        tree will claim for it) then stays behind as a cached row."""
        if not (req.finished and req.num_inflight == 0 and req.row is not None):
            return
        row = req.row
        self._blocked = False
        self._unlock(req)
        # capacity - 1: a cached row inside the decode batch needs one spare position.
        keep = min(req.num_computed, req.num_tokens, self.capacity - 1)
        if self.config.prefix_cache and keep > 0:
            self.tree.insert(req.token_ids()[:keep], row)
        cache = self.tree.holds(row)
        self.rows.release(row, req.request_id, cache=cache)
        req.row = None
        del self.running[req.request_id]

    # ---- invariants ---------------------------------------------------------------------
    def check_invariants(self, inflight: Iterable[StepPlan] = ()) -> None:
        """Raise AssertionError if request or row accounting is inconsistent."""
        self.rows.check()
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(waiting_ids)) == len(waiting_ids), "a request waits twice"
        assert not set(waiting_ids) & self.running.keys(), "a request is in two states"
        assert set(waiting_ids) == self._waiting_ids, "waiting index out of sync"
        refs: dict[str, int] = {}
        for plan in inflight:
            for rid in plan.request_ids:
                refs[rid] = refs.get(rid, 0) + 1
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING and req.row is None
        for rid, req in self.running.items():
            assert req.row is not None and self.rows.owner(req.row) == rid, "row owner mismatch"
            assert req.num_inflight == refs.get(rid, 0), f"{rid}: in-flight count is off"
            assert req.num_inflight >= 0
            if req.finished:
                assert req.num_inflight > 0, f"{rid} finished but was not released"
            elif req.status is RequestStatus.DECODE:
                expected = req.num_prompt_tokens - 1 + len(req.output_token_ids) + req.num_inflight
                assert req.num_computed == expected, f"{rid}: KV accounting is off"
            else:
                assert req.num_computed < req.num_tokens, f"{rid}: prefill overran"
        for rid in refs:
            assert rid in self.running, f"in-flight step references released {rid}"
        self._check_cache()

    def _check_cache(self) -> None:
        tree = self.tree
        tree.check()
        assert self.rows.cached <= tree.row_tail.keys(), "a cached row the tree does not hold"
        for row in tree.row_tail:
            assert row in self.rows.cached or self.rows.owner(row) is not None, (
                f"the tree holds free row {row}"
            )
            assert tree.row_length(row) < max(self.capacity, 1), "cached KV past capacity"
        expected: dict[int, int] = {}
        for req in self.running.values():
            if req.lock_node is not None:
                assert isinstance(req.lock_node, Node)
                assert req.row in req.lock_node.rows, "a lock holder lost its prefix"
                for node in req.lock_node.path():
                    expected[id(node)] = expected.get(id(node), 0) + 1
        for req in self.waiting:
            assert req.lock_node is None, "a waiting request holds a lock"
        for node in tree._nodes():
            assert node.lock == expected.get(id(node), 0), "lock count mismatch"
        if not self.running:
            assert all(n.lock == 0 for n in tree._nodes()), "locks left after drain"


def _row_sampling(reqs: list[Request | None]) -> RowSampling:
    temps, ks, ps, seeds, min_ps, min_pos = [], [], [], [], [], []
    bias: list[tuple[int, int, float]] = []
    suppress: list[tuple[int, int]] = []
    pens: list[tuple[int, float, float, float, tuple[int, ...], tuple[int, ...]]] = []
    lps: list[tuple[int, int]] = []
    constrained: list[int] = []
    for row, req in enumerate(reqs):
        p = req.params if req is not None else None
        temps.append(p.temperature if p else 0.0)
        ks.append(p.top_k if p else 0)
        ps.append(p.top_p if p else 1.0)
        seeds.append(req.seed if req is not None else 0)
        min_ps.append(p.min_p if p else 0.0)
        limit = 0
        if req is not None and p is not None:
            bias.extend((row, t, b) for t, b in p.logit_bias)
            if p.logprobs is not None:
                lps.append((row, p.logprobs))
            if req.grammar is not None:
                constrained.append(row)
            if p.penalized:
                pens.append(
                    (
                        row,
                        p.presence_penalty,
                        p.frequency_penalty,
                        p.repetition_penalty,
                        tuple(req.prompt_token_ids) if p.repetition_penalty != 1 else (),
                        tuple(req.output_token_ids),
                    )
                )
            if p.min_tokens and req.stop_ids:
                # Output i is sampled at position prompt_len - 1 + i.
                limit = req.num_prompt_tokens - 1 + p.min_tokens
                suppress.extend((row, t) for t in sorted(req.stop_ids))
        min_pos.append(limit)
    return RowSampling(
        tuple(temps),
        tuple(ks),
        tuple(ps),
        tuple(seeds),
        min_p=tuple(min_ps) if any(min_ps) else (),
        logit_bias=tuple(bias),
        min_position=tuple(min_pos) if suppress else (),
        suppress=tuple(suppress),
        penalties=tuple(pens),
        logprobs=tuple(lps),
        constrained=tuple(constrained),
    )
