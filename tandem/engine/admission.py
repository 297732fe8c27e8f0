"""Admission: which queued requests start now, and with which pages.

A request is admitted when a sequence slot is free (``max_num_seqs``) and the pool can give
pages for every token it already has (its prompt, plus its output if it was retracted) beyond
its prefix-cache hit, while keeping a reserve for the next token of every running decode.
Pages for later output tokens come one at a time as a request reaches them (the scheduler
retracts when they run out). Admission is FIFO: the head of the queue blocks the rest, except
that a head which would evict cached pages lets mostly-cached requests just behind it go first
(bounded: see ``_jump``). With recurrent layers a hit also hands the request the snapshot its
state resumes from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import islice

from tandem.engine.kv_manager import KVManager
from tandem.engine.prefix_cache import StateHit
from tandem.engine.request import Request, RequestStatus

# A request that shares this many more tokens with one admitted in the same step than the
# cache holds waits one step: then the other's prompt is in flight and cached, and it hits.
SHARED_PREFIX_WAIT = 256
# Cache-aware admission (Admission._jump): how far behind a head that would evict cached pages
# to look for mostly-cached requests that start first, and how often a head may be passed.
JUMP_LOOKAHEAD = 16
JUMP_LIMIT = 32


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Started:
    """The requests admitted in one step, by their first ``SHARED_PREFIX_WAIT`` tokens: only
    those can share that many more tokens with a later one than the cache holds. (Comparing
    each request with every one admitted before it cost 0.9 s of a 256-prompt ramp on a full
    pool, where the lookahead behind each evicting head compared its requests again.)"""

    def __init__(self) -> None:
        self.by_head: dict[tuple[int, ...], list[tuple[Request, list[int]]]] = {}

    def add(self, req: Request) -> None:
        tokens = req.token_ids()
        if len(tokens) >= SHARED_PREFIX_WAIT:
            self.by_head.setdefault(tuple(tokens[:SHARED_PREFIX_WAIT]), []).append((req, tokens))

    def sharing(self, tokens: list[int], cached: int) -> tuple[int, Request | None]:
        """The first request started in this step that shares at least ``cached +
        SHARED_PREFIX_WAIT`` tokens with ``tokens``, and how many (0, None if none)."""
        if len(tokens) < cached + SHARED_PREFIX_WAIT:
            return 0, None
        for other, theirs in self.by_head.get(tuple(tokens[:SHARED_PREFIX_WAIT]), ()):
            if (c := _common_prefix(tokens, theirs)) >= cached + SHARED_PREFIX_WAIT:
                return c, other
        return 0, None


class Admission:
    def __init__(self, kv: KVManager, max_num_seqs: int, prefix_cache: bool, stats) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.prefix_cache = prefix_cache
        self.stats = stats  # the scheduler's CacheStats: queried and hit tokens
        self.blocked = False  # the head waits for pages (a release or retraction unblocks)

    def admit(
        self,
        waiting: deque[Request],
        num_running: int,
        reserve: int,
        leader_prefilling: Callable[[Request], bool],
        window_reserve: int = 0,
    ) -> list[Request]:
        """Pop the requests that start now from the head of ``waiting``; each comes back in
        PREFILL with its page table and ``num_computed`` at its cache hit. ``reserve`` pages
        (and ``window_reserve`` of the window group, whose cached pages a hit takes: each
        running request's window room) stay for the running ones. A head that would evict
        cached pages first lets mostly-cached requests just behind it start (``_jump``)."""
        kv = self.kv
        admitted: list[Request] = []
        started = _Started()
        self.blocked = False
        while waiting and num_running + len(admitted) < self.max_num_seqs:
            req = waiting[0]
            if self.prefix_cache and leader_prefilling(req):
                break  # its prompt's KV is about to be in the cache
            found = self._match(req, started)
            if found is None:
                break  # it waits for another's prompt to be cached
            hit, need = found
            if not self._fits(req, hit, need, reserve, window_reserve):
                kv.unmatch(hit)
                self.blocked = True
                break
            slots = self.max_num_seqs - num_running - len(admitted) - 1
            if need + reserve > kv.alloc.num_free and slots > 0:
                try:
                    jumped = self._jump(waiting, slots, started, reserve, window_reserve)
                except Exception:
                    kv.unmatch(hit)
                    raise
                if jumped:
                    kv.unmatch(hit)  # (held meanwhile: the others never evicted its pages)
                    req.num_passed += len(jumped)
                    admitted += jumped
                    continue  # the head again, with what they left
            self._start(req, hit, need)
            waiting.popleft()
            admitted.append(req)
            started.add(req)
        return admitted

    def _match(
        self, req: Request, started: _Started, *, head: bool = True
    ) -> tuple[StateHit, int] | None:
        """``req``'s cache hit (referenced) and the fresh pages it needs; None (nothing
        referenced) where it should wait one step for a request admitted now to cache the
        long prefix they share (then, for the queue's ``head``, with recurrent layers the
        other keeps its state where the two part)."""
        kv = self.kv
        tokens = req.token_ids()
        # Prompt log-probabilities need every prompt position computed: no reuse. The last
        # known token is always computed (its logits give the next token).
        reuse = self.prefix_cache and req.params.prompt_logprobs is None
        hit = kv.match(tokens, len(tokens) - 1) if reuse else StateHit([], -1, 0)
        cached = len(hit.pages) * kv.page_size
        if reuse:
            common, other = started.sharing(tokens, cached)
            if other is not None:
                if head and kv.snapshots is not None:  # keep the state where the two part
                    other.snap_targets.add(common // kv.page_size * kv.page_size)
                kv.unmatch(hit)
                return None
        return hit, kv.pages_for(len(tokens)) - len(hit.pages)

    def _fits(
        self, req: Request, hit: StateHit, need: int, reserve: int, window_reserve: int
    ) -> bool:
        kv = self.kv
        # Window pages: the running requests' next ones, and this one's until it holds a
        # steady window.
        cached = len(hit.pages) * kv.page_size
        wfirst = max(
            kv.window_need(req, cached + 1, have=len(hit.wpages)),
            kv.window_commitment(req, hit.wpages),
        )
        return need + reserve <= kv.available() and window_reserve + wfirst <= kv.window_available()

    def _jump(
        self,
        waiting: deque[Request],
        slots: int,
        started: _Started,
        reserve: int,
        window_reserve: int,
    ) -> list[Request]:
        """The head of ``waiting`` would evict cached pages to start. Requests just behind it
        whose prompts are mostly cached (no more fresh pages than hit ones) start first: the
        LRU pages the head evicts would often be their hits (four 16k prompts cached in a pool
        that holds three: each admission evicted the next one's prefix, and every prompt was
        computed again), and they cost little. A head is passed over at most ``JUMP_LIMIT``
        times in its life (retractions included), then the queue is strictly FIFO again.
        Looking a request up marks its cached pages used, also where it does not start: the
        head's evictions then take others first (the protection is the point)."""
        if not self.prefix_cache or waiting[0].num_passed >= JUMP_LIMIT:
            return []
        jumped: list[Request] = []
        for req in list(islice(waiting, 1, 1 + min(slots, JUMP_LOOKAHEAD))):
            if req.follows is not None or req.params.prompt_logprobs is not None:
                continue
            found = self._match(req, started, head=False)
            if found is None:
                continue
            hit, need = found
            if need > len(hit.pages) or not self._fits(req, hit, need, reserve, window_reserve):
                self.kv.unmatch(hit)
                continue
            self._start(req, hit, need)
            waiting.remove(req)
            jumped.append(req)
            started.add(req)
            if len(jumped) + waiting[0].num_passed >= JUMP_LIMIT:
                break
        return jumped

    def _start(self, req: Request, hit: StateHit, need: int) -> None:
        """Admit ``req`` (still in the queue) with its hit and ``need`` fresh pages."""
        kv = self.kv
        try:  # before it leaves the queue
            req.pages = hit.pages + kv.allocate(need)
        except Exception:
            kv.unmatch(hit)
            raise
        cached = len(hit.pages) * kv.page_size
        # The window group's pages come as positions are written (scheduler._chunk).
        req.wpages = list(hit.wpages)
        req.wfree = next((i for i, pg in enumerate(req.wpages) if pg >= 0), 0)
        # A recurrent model resumes from the hit's state; where the cache matched more tokens
        # than it has a state for, keep the state there this time.
        req.state_src = hit.snapshot
        if hit.matched > cached:
            req.snap_targets.add(hit.matched)
        if req.num_retractions == 0:
            self.stats.queried_tokens += req.num_prompt_tokens
            self.stats.hit_tokens += cached
        if not req.cache_reported:  # what the client will be told: this admission's hit
            req.num_cached_tokens = cached
        req.num_computed = cached
        req.status = RequestStatus.PREFILL
