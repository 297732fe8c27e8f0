"""The one manager of KV memory on the scheduler's side: the page pool's allocator, the
prefix cache over it, the budget (pages in use + cached <= pool), and for models with
recurrent layers the snapshot slots the prefix cache keeps states in (and speculative
verifies keep the state they start from in)."""

from __future__ import annotations

from tandem.engine.pages import PageAllocator
from tandem.engine.prefix_cache import PrefixCache, StateHit
from tandem.engine.state_slots import Snapshots


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        prefix_cache: bool,
        snapshots: Snapshots | None = None,
    ) -> None:
        self.page_size = page_size
        self.alloc = PageAllocator(num_pages)
        # Recurrent models: no snapshot slots, no prefix cache (nothing to resume from).
        if snapshots is not None and snapshots.num == 0:
            prefix_cache, snapshots = False, None
        # The slots, also without the prefix cache (a verify's backup); ``snapshots`` only
        # where the prefix cache keeps states in them.
        self.states = snapshots
        self.snapshots = snapshots if prefix_cache else None
        self.tree = PrefixCache(self.alloc, page_size, self.snapshots) if prefix_cache else None
        self.evicted_pages = 0
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
        recurrent layers cut at the deepest snapshot, whose slot is referenced too."""
        if self.tree is None:
            return StateHit([], -1, 0)
        if self.snapshots is None:
            pages = self.tree.match(tokens, limit)
            hit = StateHit(pages, -1, len(pages) * self.page_size)
        else:
            hit = self.tree.match_state(tokens, limit)
            if hit.snapshot >= 0:
                self.snapshots.incref(hit.snapshot)
        self.alloc.incref(hit.pages)
        return hit

    def unmatch(self, hit: StateHit) -> None:
        """Give back what ``match`` referenced."""
        self.alloc.decref(hit.pages)
        self.drop_snapshot(hit.snapshot)

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
        if slot >= 0:
            assert self.states is not None
            self.states.decref(slot)

    def cache(self, tokens: list[int], pages: list[int], length: int, locks: set[int]) -> int:
        """Offer the whole pages of positions ``[0, length)`` (written with ``tokens``) of a
        request whose extra page locks are ``locks`` (updated: the tree's own pages on the
        path, which the request must keep alive while it lives). Returns the positions now
        cached."""
        if self.tree is None:
            return 0
        n = min(length // self.page_size, len(pages))
        if n:
            new = [p for p in self.tree.insert(tokens[: n * self.page_size], pages[:n])]
            new = [p for p in dict.fromkeys(new) if p not in locks]
            self.alloc.incref(new)
            locks.update(new)
        return n * self.page_size

    def release(self, pages: list[int], locks: set[int] | None = None) -> None:
        self.alloc.decref(pages)
        if locks:
            self.alloc.decref(list(locks))
            locks.clear()

    def clear_cache(self) -> None:
        if self.tree is not None:
            self.tree.clear()
