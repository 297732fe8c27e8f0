"""The one manager of KV memory on the scheduler's side: the page pool's allocator, the
prefix cache over it, the budget (pages in use + cached <= pool), and for models with
recurrent layers the snapshot slots the prefix cache keeps states in (and speculative
verifies keep the state they start from in).

Models with sliding-window layers have a second page group (``window``, ``walloc``): those
layers' pools hold fewer pages, a request's ``wpages`` table lists them at the same
positions as ``pages``, they are allocated as positions are written (``grow_window``) and
freed once wholly behind the widest window (``free_behind``), so a long request holds about
W positions of them, not its length. -1 in ``wpages`` marks a freed (or never cached)
page, which no step reads.
"""

from __future__ import annotations

from tandem.engine.pages import PageAllocator
from tandem.engine.prefix_cache import PrefixCache, StateHit
from tandem.engine.request import Request
from tandem.engine.state_slots import PositionSlots, Snapshots


def min_window_pages(window: int, page_size: int) -> int:
    """The fewest window-group pages that serve: a request alone holds its window's pages
    and needs one more to go on."""
    return -(-window // page_size) + 2


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        prefix_cache: bool,
        snapshots: Snapshots | None = None,
        window: int = 0,
        window_pages: int = 0,
        positions: PositionSlots | None = None,
    ) -> None:
        self.page_size = page_size
        self.alloc = PageAllocator(num_pages)
        # The window group: positions the widest window reads (0: no group), its pages.
        self.window = window if window_pages else 0
        self.walloc = PageAllocator(window_pages) if self.window else None
        least = min_window_pages(window, page_size)
        if self.window and window_pages < least:
            raise ValueError(
                f"{window_pages} window pages cannot hold a window of {window} positions "
                f"(at least {least} pages of {page_size})"
            )
        # Recurrent models: no snapshot slots, no prefix cache (nothing to resume from).
        if snapshots is not None and snapshots.num == 0:
            prefix_cache, snapshots = False, None
        # The slots, also without the prefix cache (a verify's backup); ``snapshots`` only
        # where the prefix cache keeps states in them.
        self.states = snapshots
        self.snapshots = snapshots if prefix_cache else None
        self.positions = positions  # a verify's states per position (no pool memory)
        self.tree = (
            PrefixCache(
                self.alloc, page_size, self.snapshots, window_alloc=self.walloc, window=self.window
            )
            if prefix_cache
            else None
        )
        self.evicted_pages = 0
        self.dropped_window_pages = 0
        self.evicted_snapshots = 0

    @property
    def num_pages(self) -> int:
        return self.alloc.num_pages

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    @property
    def num_cached(self) -> int:
        """Pages only the prefix cache holds (reclaimable)."""
        return self.alloc.num_cached

    @property
    def num_held(self) -> int:
        """Pages live requests hold (shared pages once)."""
        return self.alloc.num_used - self.num_cached

    def available(self) -> int:
        return self.alloc.num_free + self.num_cached

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting cached ones if the free list is short. The caller has
        checked ``available()``; PagesExhausted if it lied."""
        short = n - self.alloc.num_free
        if short > 0 and self.tree is not None:
            self.evicted_pages += self.tree.evict(short)
        return self.alloc.allocate(n)

    def match(self, tokens: list[int], limit: int) -> StateHit:
        """Cached pages for a prefix of ``tokens[:limit]``, referenced for the caller; with
        recurrent layers cut at the deepest snapshot, whose slot is referenced too; with a
        window group where the window's pages are cached."""
        if self.tree is None:
            return StateHit([], -1, 0)
        hit = self.tree.match_hit(tokens, limit)
        if hit.snapshot >= 0:
            assert self.snapshots is not None
            self.snapshots.incref(hit.snapshot)
        self.alloc.incref(hit.pages)
        if self.walloc is not None:
            self.walloc.incref([pg for pg in hit.wpages if pg >= 0])
        return hit

    def unmatch(self, hit: StateHit) -> None:
        """Give back what ``match`` referenced."""
        self.alloc.decref(hit.pages)
        if self.walloc is not None:
            self.walloc.decref([pg for pg in hit.wpages if pg >= 0])
        self.drop_snapshot(hit.snapshot)

    # ---- the window group -------------------------------------------------------------
    @property
    def window_held(self) -> int:
        """Window-group pages live requests hold (0 without the group)."""
        if self.walloc is None:
            return 0
        return self.walloc.num_used - self.walloc.num_cached

    def window_available(self) -> int:
        if self.walloc is None:
            return 1 << 62
        return self.walloc.num_free + self.walloc.num_cached

    def window_need(self, req: Request, end: int, have: int | None = None) -> int:
        """Window pages ``req`` lacks for positions ``[0, end)`` (``have``: its table's
        length, if not yet set)."""
        if self.walloc is None:
            return 0
        return max(0, self.pages_for(end) - (len(req.wpages) if have is None else have))

    def window_commitment(self, req: Request, wpages: list[int] | None = None) -> int:
        """Window pages ``req`` will still take before it holds a steady window (its
        window's pages and the next one; fewer if it never grows that long): admission
        keeps them for it, so requests admitted on full pages alone do not run the window
        group short and retract each other. ``wpages``: its table, if not yet set."""
        if self.walloc is None:
            return 0
        table = req.wpages if wpages is None else wpages
        held = sum(pg >= 0 for pg in table[req.wfree if wpages is None else 0 :])
        steady = min(self.pages_for(self.window) + 2, self.pages_for(req.max_len))
        return max(0, steady - held)

    def grow_window(self, req: Request, end: int) -> None:
        """Window pages for positions up to ``end`` (the caller checked the room)."""
        n = self.window_need(req, end)
        if n:
            assert self.walloc is not None
            short = n - self.walloc.num_free
            if short > 0 and self.tree is not None:
                self.dropped_window_pages += self.tree.drop_window(short)
            req.wpages += self.walloc.allocate(n)

    def free_behind(self, req: Request, start: int) -> None:
        """Free the window pages no step from position ``start`` on reads: those wholly
        before the widest window of ``start`` (the prefix cache may keep them)."""
        if self.walloc is None:
            return
        dead = min(max(0, start - self.window + 1) // self.page_size, len(req.wpages))
        for i in range(req.wfree, dead):
            if req.wpages[i] >= 0:
                self.walloc.decref([req.wpages[i]])
                req.wpages[i] = -1
        req.wfree = max(req.wfree, dead)

    def truncate(self, req: Request, keep: int) -> None:
        """Give back ``req``'s pages (both groups) past its first ``keep``."""
        if len(req.pages) > keep:
            self.alloc.decref(req.pages[keep:])
            del req.pages[keep:]
        if len(req.wpages) > keep:
            assert self.walloc is not None
            self.walloc.decref([pg for pg in req.wpages[keep:] if pg >= 0])
            del req.wpages[keep:]

    # ---- recurrent-state snapshot slots (self.states; the tree's where self.snapshots) ----
    def new_snapshot(self) -> int:
        """A free snapshot slot (the least recently used cached states give theirs up), or
        -1 when every slot is in use by a request."""
        assert self.states is not None
        slot = self.states.allocate()
        while slot < 0 and self.tree is not None and self.tree.evict_snapshot():
            self.evicted_snapshots += 1
            slot = self.states.allocate()
        return slot

    def wants_snapshot(self, tokens: list[int], pos: int) -> bool:
        """Whether the state after ``tokens[:pos]`` is worth keeping: the cache has none."""
        assert self.tree is not None
        return self.tree.snapshot_at(tokens, pos) < 0

    def keep_snapshot(self, tokens: list[int], pos: int, slot: int) -> None:
        """The state after ``tokens[:pos]`` (whose pages are cached) is in ``slot``: the
        cache takes the caller's reference, or it is dropped if the cache has that state."""
        assert self.tree is not None
        if not self.tree.attach(tokens, pos, slot):
            self.drop_snapshot(slot)

    def drop_snapshot(self, slot: int) -> None:
        if slot >= 0 and self.positions is not None and slot in self.positions:
            self.positions.free(slot)
        elif slot >= 0:
            assert self.states is not None
            self.states.decref(slot)

    def cache(self, req: Request, tokens: list[int], length: int) -> int:
        """Offer the whole pages of positions ``[0, length)`` (written with ``tokens``) of
        ``req``, whose extra page locks (``locked_pages``) are updated: the tree's own pages
        on the path, which the request must keep alive while it lives. Returns the
        positions now cached."""
        if self.tree is None:
            return 0
        pages, locks = req.pages, req.locked_pages
        n = min(length // self.page_size, len(pages))
        if self.walloc is not None:
            n = min(n, len(req.wpages))
        if n:
            wpages = req.wpages[:n] if self.walloc is not None else ()
            new = [p for p in self.tree.insert(tokens[: n * self.page_size], pages[:n], wpages)]
            new = [p for p in dict.fromkeys(new) if p not in locks]
            self.alloc.incref(new)
            locks.update(new)
        return n * self.page_size

    def release(self, req: Request) -> None:
        """Give back every page ``req`` holds or locks."""
        self.truncate(req, 0)
        req.wfree = 0
        if req.locked_pages:
            self.alloc.decref(list(req.locked_pages))
            req.locked_pages.clear()

    def clear_cache(self) -> None:
        if self.tree is not None:
            self.tree.clear()
