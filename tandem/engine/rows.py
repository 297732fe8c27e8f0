"""KV row allocation. A row is free, owned by one live request, or cached (held only by the
prefix cache) — exactly one of the three."""

from __future__ import annotations

import heapq


class RowAllocator:
    """Hands out the lowest free row so the decode batch (rows 0..hi-1) stays dense."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows))
        self._owner: dict[int, str] = {}
        self.cached: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_owned(self) -> int:
        return len(self._owner)

    @property
    def high_water(self) -> int:
        """One past the highest owned row (0 when none is): the decode batch's width."""
        return max(self._owner) + 1 if self._owner else 0

    @property
    def span(self) -> int:
        """One past the highest row holding KV anyone may read (owned or cached)."""
        return max(self.high_water, max(self.cached) + 1 if self.cached else 0)

    def peek(self) -> int | None:
        return self._free[0] if self._free else None

    def lowest_free_above(self, row: int) -> int | None:
        return min((r for r in self._free if r > row), default=None)

    def move_cached(self, old: int, new: int) -> None:
        """Cached KV moved from row ``old`` to free row ``new``; ``old`` becomes free."""
        self._free.remove(new)
        heapq.heapify(self._free)
        self.cached.remove(old)
        self.cached.add(new)
        heapq.heappush(self._free, old)

    def allocate(self, owner: str) -> int:
        row = heapq.heappop(self._free)
        self._owner[row] = owner
        return row

    def adopt(self, row: int, owner: str) -> None:
        """A cached row becomes owned (a prefix hit reusing it in place)."""
        self.cached.remove(row)
        self._owner[row] = owner

    def release(self, row: int, owner: str, *, cache: bool = False) -> None:
        if self._owner.get(row) != owner:
            raise RuntimeError(f"row {row} is not owned by {owner}")
        del self._owner[row]
        if cache:
            self.cached.add(row)
        else:
            heapq.heappush(self._free, row)

    def evict(self, row: int) -> None:
        """A cached row becomes free."""
        self.cached.remove(row)
        heapq.heappush(self._free, row)

    def owner(self, row: int) -> str | None:
        return self._owner.get(row)

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a row is free twice"
        assert not free & self._owner.keys(), "a row is both free and owned"
        assert not free & self.cached, "a row is both free and cached"
        assert not self.cached & self._owner.keys(), "a row is both owned and cached"
        assert len(free) + len(self._owner) + len(self.cached) == self.num_rows, "a row was lost"
