"""Recurrent-state slots: the one manager of the runner's per-sequence state pool on the
scheduler's side. A request holds a slot from admission until its pages are released (the
same late release), so no two requests in flight ever share one."""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        assert self._free, "more running requests than state slots"
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self._held, f"state slot {slot} released twice"
        self._held.remove(slot)
        self._free.append(slot)

    def check(self, holders: list[int]) -> None:
        assert len(set(holders)) == len(holders), "two requests hold one state slot"
        assert set(holders) == self._held, "state slots held by no request (or unbooked)"
        assert len(self._free) + len(self._held) == self.num_slots
