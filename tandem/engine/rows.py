"""KV row allocation: each admitted request owns one row of the runner's KV buffers."""

from __future__ import annotations

import heapq


class RowAllocator:
    """Hands out the lowest free row so the decode batch (rows 0..hi-1) stays dense."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def high_water(self) -> int:
        """One past the highest row in use (0 when none is)."""
        return max(self._owner) + 1 if self._owner else 0

    def peek(self) -> int | None:
        return self._free[0] if self._free else None

    def allocate(self, owner: str) -> int:
        row = heapq.heappop(self._free)
        self._owner[row] = owner
        return row

    def release(self, row: int, owner: str) -> None:
        if self._owner.get(row) != owner:
            raise RuntimeError(f"row {row} is not owned by {owner}")
        del self._owner[row]
        heapq.heappush(self._free, row)

    def owner(self, row: int) -> str | None:
        return self._owner.get(row)

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a row is free twice"
        assert not free & self._owner.keys(), "a row is both free and owned"
        assert len(free) + len(self._owner) == self.num_rows, "a row was lost"
