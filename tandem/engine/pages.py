"""KV page allocation: a page is free, or held with a reference count (each request whose page
table lists it, plus the prefix cache if it references it)."""

from __future__ import annotations


class PagesExhausted(RuntimeError):
    """More pages were asked for than are free: a scheduler bug, not a device OOM."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.in_tree = [False] * num_pages
        self.num_cached = 0  # pages whose only reference is the prefix cache's
        # A stack, lowest page on top: the pages in use stay packed at the low end.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PagesExhausted(f"{n} KV pages wanted, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def incref(self, pages: list[int] | tuple[int, ...]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"incref of free page {p}"
            if self.refs[p] == 1 and self.in_tree[p]:
                self.num_cached -= 1
            self.refs[p] += 1

    def decref(self, pages: list[int] | tuple[int, ...]) -> int:
        """Drop one reference of each page; returns how many became free."""
        freed = 0
        for p in pages:
            assert self.refs[p] > 0, f"decref of free page {p}"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
                freed += 1
            elif self.refs[p] == 1 and self.in_tree[p]:
                self.num_cached += 1
        return freed

    def tree_ref(self, pages: list[int]) -> None:
        """The prefix cache starts referencing ``pages`` (held by their writer)."""
        for p in pages:
            assert not self.in_tree[p] and self.refs[p] > 0
            self.refs[p] += 1
            self.in_tree[p] = True

    def tree_unref(self, pages: list[int]) -> int:
        """The prefix cache drops ``pages``; returns how many became free."""
        freed = 0
        for p in pages:
            assert self.in_tree[p]
            if self.refs[p] == 1:
                self.num_cached -= 1
            self.in_tree[p] = False
            freed += self.decref([p])
        return freed

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        cached = 0
        for p, r in enumerate(self.refs):
            assert r >= 0
            assert (r == 0) == (p in free), f"page {p}: {r} references but free={p in free}"
            assert not (self.in_tree[p] and r == 0), f"the tree lists free page {p}"
            cached += self.in_tree[p] and r == 1
        assert cached == self.num_cached, "cached page count out of sync"
