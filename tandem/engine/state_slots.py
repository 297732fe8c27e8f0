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


class Snapshots:
    """Snapshot slots of the state pool (slots ``[first, first + num)``): a recurrent state
    copied at a page boundary, so a later request whose prompt shares the tokens up to that
    position resumes from it (a state cannot be rewound, only restored). A slot is free or
    referenced by: the prefix-cache node it is attached to, the running request whose
    checkpoint it is, requests admitted on it whose first chunk has not launched yet, and a
    speculative verify's backup (the state it started from, engine/results.py) until the
    verify is applied or the replay reading it launches."""

    def __init__(self, first: int, num: int) -> None:
        self.first = first
        self.num = num
        self.refs: dict[int, int] = {}
        self._free: list[int] = []
        self.reset()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot with one reference (the caller's), or -1 when none is free."""
        if not self._free:
            return -1
        slot = self._free.pop()
        self.refs[slot] = 1
        return slot

    def incref(self, slot: int) -> None:
        assert self.refs.get(slot, 0) > 0, f"incref of free snapshot slot {slot}"
        self.refs[slot] += 1

    def decref(self, slot: int) -> None:
        assert self.refs.get(slot, 0) > 0, f"decref of free snapshot slot {slot}"
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            del self.refs[slot]
            self._free.append(slot)

    def reset(self) -> None:
        """Every slot free: after a step failure the pool's states are gone, and so is every
        holder (the tree is cleared, every request released)."""
        self.refs = {}
        self._free = list(range(self.first + self.num - 1, self.first - 1, -1))

    def check(self, holders: dict[int, int]) -> None:
        assert self.refs == holders, f"snapshot slot references {self.refs} != {holders}"
        assert len(self._free) + len(self.refs) == self.num
        assert not set(self._free) & set(self.refs), "a snapshot slot is free and held"


class PositionSlots:
    """Slot ids for a verify's states after each of its positions (runner/positions.py),
    numbered after the pool's slots: the runner holds those states where the layers left
    them (runner/state.py), so an id takes no pool memory. One holder each: the verify in
    flight, then the request resuming from it until that step launches. Ids freed since the
    last plan go out with the next (``take_freed``), and the runner lets go of their states."""

    def __init__(self, first: int, num: int) -> None:
        self.first = first
        self.num = num
        self._free: list[int] = []
        self._freed: list[int] = []
        self.reset()

    def __contains__(self, slot: int) -> bool:
        return self.first <= slot < self.first + self.num

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free id, or -1 when none is."""
        return self._free.pop() if self._free else -1

    def free(self, slot: int) -> None:
        assert slot in self and slot not in self._free, f"position slot {slot} freed twice"
        self._free.append(slot)
        self._freed.append(slot)

    def take_freed(self) -> tuple[int, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed

    def reset(self) -> None:
        """Every id free (after a step failure the runner's held states are gone too)."""
        self._free = list(range(self.first + self.num - 1, self.first - 1, -1))
        self._freed = []

    def check(self, holders: list[int]) -> None:
        assert len(set(holders)) == len(holders), "two holders of one position slot"
        assert not set(holders) & set(self._free), "a position slot is free and held"
        assert len(self._free) + len(holders) == self.num, "position slots lost"


def state_managers(
    slots: int, snapshots: int, positions: int
) -> tuple[StateSlots | None, Snapshots | None, PositionSlots | None]:
    """The scheduler's managers of a recurrent model's state pool: the running requests'
    slots, the snapshot slots after them and the per-position ids after those (None where
    the model has no recurrent layers, or there are no such ids)."""
    if not slots:
        return None, None, None
    ids = PositionSlots(slots + snapshots, positions) if positions else None
    return StateSlots(slots), Snapshots(slots, snapshots), ids
