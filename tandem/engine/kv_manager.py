"""The one manager of KV memory on the scheduler's side: the page pool's allocator, the
prefix cache over it, and the budget (pages in use + cached <= pool)."""

from __future__ import annotations

from tandem.engine.pages import PageAllocator
from tandem.engine.prefix_cache import PrefixCache


class KVManager:
    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool) -> None:
        self.page_size = page_size
        self.alloc = PageAllocator(num_pages)
        self.tree = PrefixCache(self.alloc, page_size) if prefix_cache else None
        self.evicted_pages = 0

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

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """Cached pages for a prefix of ``tokens[:limit]``, referenced for the caller."""
        if self.tree is None:
            return []
        pages = self.tree.match(tokens, limit)
        self.alloc.incref(pages)
        return pages

    def cache(self, tokens: list[int], pages: list[int], length: int, locks: set[int]) -> None:
        """Offer the whole pages of positions ``[0, length)`` (written with ``tokens``) of a
        request whose extra page locks are ``locks`` (updated: the tree's own pages on the
        path, which the request must keep alive while it lives)."""
        if self.tree is None:
            return
        n = min(length // self.page_size, len(pages))
        if n:
            new = [p for p in self.tree.insert(tokens[: n * self.page_size], pages[:n])]
            new = [p for p in dict.fromkeys(new) if p not in locks]
            self.alloc.incref(new)
            locks.update(new)

    def release(self, pages: list[int], locks: set[int] | None = None) -> None:
        self.alloc.decref(pages)
        if locks:
            self.alloc.decref(list(locks))
            locks.clear()

    def clear_cache(self) -> None:
        if self.tree is not None:
            self.tree.clear()
