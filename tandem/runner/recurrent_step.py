"""A step of a model with recurrent layers: one model call on the step's single-token
segments (each row its request's state; one more for rows starting a sequence), and for the
multi-token segments (prefill chunks, speculative verifies, replays) one ``(B, n)`` call per
piece of each group of them cut alike (equally long, cut where a snapshot of the state is
kept), each row a sequence its recurrence runs along (runner/state.py holds the states)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from tandem.engine.plan import Segment, StepPlan
from tandem.runner.state import Reads, StepState

if TYPE_CHECKING:
    from tandem.runner.model_runner import ModelRunner


def slots(values: list[int]) -> mx.array:
    """State slot indices as an array."""
    return mx.array(values, dtype=mx.int32)


def submit_call(runner: ModelRunner, logits: mx.array) -> None:
    """On the CPU, where the state pool is written by MLX's scatter, start a call's work (its
    logits and writes) before the step's next call is built on it: a scatter writes in place
    only where nothing else holds the old buffer when it runs, and with the step submitted
    whole the next call's scatters copied the pool's buffers (docs/benchmarks.md, twelfth
    session). The step's last call too: submitting it only with the launch read 18.9-21.2 s
    against 16.2-18.1 on the same run. Elsewhere (in-place writes on CUDA; Metal, not
    measured) the step goes as one."""
    sp = runner.state_pool
    if sp is None or sp.inplace or mx.default_device() != mx.cpu:
        return
    work = [logits, *(b for layer in sp.bufs for b in layer if b is not None)]
    pool = runner.pool
    if pool is not None and not pool.inplace:
        work += pool.arrays()
    mx.async_eval(work)


def forward(runner: ModelRunner, plan: StepPlan, inputs: mx.array, head: list[int]) -> mx.array:
    """A model with recurrent layers: one call on the step's single-token segments (each
    row its request's state; one more for those starting at 0) and one per piece of each
    group of multi-token segments cut alike (``_batches``, ``_sequences``); the head rows'
    logits back in ``head`` order."""
    sp = runner.state_pool
    assert sp is not None  # (the runner let go of the plan's released states)
    starts, t = [], 0
    for seg in plan.segments:
        starts.append(t)
        t += seg.num_tokens
    where = {h: i for i, h in enumerate(head)}
    outs: list[mx.array] = []
    order: list[int] = []  # head index of each output row, in output order

    # Single-token segments in one call; those that start a sequence in another that
    # reads no state (a model may treat an empty cache unlike a zero state). The first
    # call's new states stay resident for a next step of the same rows (runner.state).
    groups = [
        [
            i
            for i, seg in enumerate(plan.segments)
            if seg.num_tokens == 1 and fresh == (seg.start == 0)
        ]
        for fresh in (False, True)
    ]
    rows_slots = tuple(plan.segments[i].state_slot for i in groups[0])
    initial = None
    if (
        sp.resident is not None
        and sp.resident[0] == rows_slots
        and all(plan.segments[i].state_src < 0 for i in groups[0])
    ):
        initial = sp.resident[1]
        sp.resident = None
    else:
        sp.flush()  # before anything of this step reads or writes a slot
    for fresh, singles in zip((False, True), groups, strict=True):
        if not singles:
            continue
        segs = [plan.segments[i] for i in singles]
        tok = [starts[i] for i in singles]
        assert all(seg.state_slot >= 0 for seg in segs), "a recurrent row without a slot"
        write = slots([seg.state_slot for seg in segs])
        # Nothing to read: sequences starting at 0, or the resident states of these rows.
        resident = initial is not None and not fresh
        read = None if fresh or resident else Reads(sp, [seg.state_read for seg in segs])
        assert all(pos == seg.end for seg in segs for pos, _ in seg.snapshots)
        assert all(seg.state_backup < 0 and not seg.state_positions for seg in segs), (
            "a verify of one token"
        )
        copies = [(k, slot) for k, seg in enumerate(segs) for _, slot in seg.snapshots]
        copy = (slots([k for k, _ in copies]), slots([s for _, s in copies])) if copies else None
        keep: list | None = None if fresh else [None] * len(sp.specs)
        states = [
            StepState(
                sp,
                j,
                write,
                read,
                copy,
                initial=initial[j] if resident and initial is not None else None,
                keep=keep,
            )
            for j in range(len(sp.specs))
        ]
        rows = [k for k, t0 in enumerate(tok) if t0 in where]
        order += [where[tok[k]] for k in rows]
        x = inputs if tok == list(range(len(inputs))) else inputs[mx.array(tok)]
        outs.append(runner.call(runner.context(segs), x[:, None], rows, states))
        submit_call(runner, outs[-1])
        if keep is not None:
            sp.resident = (rows_slots, keep)
    multi = [i for i, seg in enumerate(plan.segments) if seg.num_tokens > 1]
    for group in _batches(runner, plan.segments, multi):
        outs += _sequences(runner, plan.segments, group, inputs, starts, where, order)
    logits = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if order != list(range(len(order))):
        logits = logits[mx.array(np.argsort(np.asarray(order)).astype(np.int32))]
    return logits


def _cuts(seg: Segment) -> tuple[int, ...]:
    """Where a segment's calls end, relative to its start: at each snapshot it keeps before
    its end (the state there is copied out between two calls), and at its end."""
    inside = sorted({pos - seg.start for pos, _ in seg.snapshots if pos < seg.end})
    assert all(cut > 0 for cut in inside), "a snapshot at a segment's start"
    return (*inside, seg.num_tokens)


def _batches(runner: ModelRunner, segments: tuple[Segment, ...], multi: list[int]) -> list:
    """The multi-token segments in groups that share their model calls: equally long ones
    that start alike (at 0 or not), with or without a backup alike, cut at the same offsets
    (where the runner's load check passed the batched layout; else each alone)."""
    if not runner.batch_sequences:
        return [[i] for i in multi]
    groups: dict[tuple, list[int]] = {}
    for i in multi:
        seg = segments[i]
        key = (seg.start == 0, seg.state_backup >= 0, bool(seg.state_positions), _cuts(seg))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _sequences(
    runner: ModelRunner,
    segments: tuple[Segment, ...],
    group: list[int],
    inputs: mx.array,
    starts: list[int],
    where: dict[int, int],
    order: list[int],
) -> list[mx.array]:
    """``group``'s equally long segments as a (B, n) batch of sequences, one call per piece
    between their cuts: each row reads its state (none where they start at 0; a verify's
    copied to its backup slot first), then its own slot; a snapshot at a cut is copied from
    its row. Appends the head indices of the rows whose logits it returns to ``order``."""
    sp = runner.state_pool
    assert sp is not None
    segs = [segments[i] for i in group]
    assert all(seg.state_slot >= 0 for seg in segs), "a recurrent row without a slot"
    own = [seg.state_slot for seg in segs]
    write = slots(own)
    snaps = [dict(seg.snapshots) for seg in segs]
    outs = []
    a = 0
    for b in _cuts(segs[0]):
        read = None  # (sequences starting at 0 read nothing)
        if a:
            read = Reads(sp, own)
        elif segs[0].start:
            read = Reads(sp, [seg.state_read for seg in segs])
        copies = [
            (r, snap[seg.start + b])
            for r, (seg, snap) in enumerate(zip(segs, snaps, strict=True))
            if seg.start + b in snap
        ]
        copy = (slots([r for r, _ in copies]), slots([s for _, s in copies])) if copies else None
        # A verify keeps the state it starts from (a rejected proposal replays from it).
        backup = None
        if a == 0 and segs[0].state_backup >= 0:
            backup = slots([seg.state_backup for seg in segs])
        assert backup is None or read is not None
        # A verify that keeps its states per position: those of this piece's positions,
        # held where the layers left them (runner/state.py).
        keep = None
        if segs[0].state_positions and a < len(segs[0].state_positions):
            held = [list(seg.state_positions[a:b]) for seg in segs]
            keep = (sp.hold(held), len(held[0]))
        states = [
            StepState(sp, j, write, read, copy, backup=backup, positions=keep)
            for j in range(len(sp.specs))
        ]
        n = b - a
        rows: list[int] = []
        for r, i in enumerate(group):
            for k in range(a, b):
                if starts[i] + k in where:
                    rows.append(r * n + k - a)
                    order.append(where[starts[i] + k])
        if len(group) == 1:
            x = inputs[starts[group[0]] + a : starts[group[0]] + b][None]
        else:
            tokens = [starts[i] + k for i in group for k in range(a, b)]
            x = inputs[mx.array(tokens, dtype=mx.int32)].reshape(len(group), n)
        pieces = [
            replace(seg, start=seg.start + a, num_tokens=n, token_ids=seg.token_ids[a:b])
            for seg in segs
        ]
        outs.append(runner.call(runner.context(pieces, sequence=True), x, rows, states))
        submit_call(runner, outs[-1])
        a = b
    return outs
