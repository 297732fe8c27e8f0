"""Where a model with recurrent layers keeps states for the prefix cache (the policy; the
slots are ``Snapshots`` in state_slots.py, the tree holds them in prefix_cache.py). A state
is kept at a page boundary, as a copy the step makes (``Segment.snapshots``), where a later
request is likely to resume: see docs/design.md, "Prefix hits on recurrent models"."""

from __future__ import annotations

from collections.abc import Iterable

from tandem.engine.kv_manager import KVManager
from tandem.engine.request import Request

Snaps = tuple[tuple[int, int], ...]  # (position, snapshot slot), ascending


def for_chunk(
    kv: KVManager, req: Request, tokens: list[int], start: int, end: int
) -> tuple[int, Snaps]:
    """A prefill chunk ``[start, end)`` of ``tokens`` keeps its state: at its end when the
    budget cuts it (moved back to a page boundary), at the last page boundary a repeat of
    these tokens could hit, and where the cache wants it (prompts part there). Returns the
    chunk's end and its snapshots."""
    p = kv.page_size
    n = len(tokens)
    want = {pos for pos in req.snap_targets if start < pos <= end}
    if end < n and end // p * p > start:
        end = end // p * p
        want.add(end)
    last = (n - 1) // p * p  # a repeat of the whole prompt hits up to here
    if start < last <= end:
        want.add(last)
    snaps = []
    for pos in sorted(want):
        if pos > end or pos % p or not kv.wants_snapshot(tokens, pos):
            continue
        slot = kv.new_snapshot()
        if slot < 0:
            break
        snaps.append((pos, slot))
    req.snap_targets = {pos for pos in req.snap_targets if pos > end}
    return end, tuple(snaps)


def checkpoint(kv: KVManager, running: Iterable[Request], req: Request, end: int) -> Snaps:
    """A decode of ``req`` reaching page boundary ``end`` copies its state to the request's
    checkpoint slot (its last one is cached with its pages when it ends)."""
    snapshots = kv.snapshots
    if snapshots is None or end % kv.page_size:
        return ()
    if req.checkpoint < 0:
        # Checkpoints hold at most half the slots: many long decodes must not leave new
        # prompts no room to keep their states.
        held = sum(r.checkpoint >= 0 for r in running)
        if 2 * (held + 1) > snapshots.num:
            return ()
        req.checkpoint = kv.new_snapshot()
        if req.checkpoint < 0:
            return ()
    req.checkpoint_pos = end
    return ((end, req.checkpoint),)
