"""A step's layout, built once from the plan and shared by every layer.

A paged step feeds its tokens as a batch of single-token sequences. Single-token segments
(decodes) are attended in groups of similar length over their own pages (or all in one group
by the decode kernel, which also takes each position of a speculative verify segment); a
multi-token segment (a prefill chunk) gathers its own pages — or, starting at 0, attends to
its fresh keys (new prompts batched: ``step_groups``). A sliding-window layer reads only the
last W positions of each segment, so its cost is bounded by the window; the per-window layouts are
built on first use and shared by every layer of that window. A dense layer (``layers``) gets
each token's own history, gathered and padded, with the mask of its real positions. A model
with recurrent layers is called once on its decodes and once per piece of each group of
multi-token segments cut alike, each segment a sequence of a (B, n) batch (``sequence``), so
its recurrence runs along the segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tandem.engine.plan import Segment
from tandem.runner import kernels, kv_quant
from tandem.runner.step_groups import ChunkItem, batch_fresh, group_decodes

BATCH_FRESH = True  # new prompts' chunks batched (step_groups.batch_fresh; off: A/B runs)


def first_key(pos, span: int | None):
    """The first position a query at ``pos`` (a number or a numpy array) attends to, for a
    layer that reads ``span`` (``LayerSpec.span``): everything (None), a sliding window of W
    (W > 0: the query and the W - 1 before it) or its chunk of C (-C: llama4's chunked
    attention, from the chunk's first position)."""
    if span is None:
        return 0 * pos
    if span < 0:
        return pos // -span * -span
    if isinstance(pos, np.ndarray):
        return np.maximum(0, pos - span + 1)
    return max(0, pos - span + 1)  # (per decode row each step: no numpy scalar)


def table_head_rows(tables: mx.array, page: int, longest: int, hkv: int) -> mx.array:
    """(2, B, Hkv, longest): the first ``longest`` positions of each row's page ``tables``
    (B, pages) in a float pool, keys and values head by head (``kv_quant.head_rows``)."""
    return kv_quant.head_rows(table_slots(tables, page)[:, :longest], hkv)


def table_slots(tables: mx.array, page: int) -> mx.array:
    """(B, pages x page): every slot of each row's page ``tables``, in position order."""
    cols = tables[:, :, None] * page + mx.arange(page, dtype=mx.int32)
    return cols.reshape(tables.shape[0], -1)


def key_mask(longest: int, lengths: mx.array, starts: mx.array | None) -> mx.array:
    """(B, 1, 1, longest) bool: the gathered keys each row reads (before its length, from
    its first key where ``starts`` gives one)."""
    cols = mx.arange(longest, dtype=mx.int32)[None]
    m = cols < lengths[:, None]
    if starts is not None:
        m = m & (cols >= starts[:, None])
    return m[:, None, None, :]


class DecodeGroup:
    """Single-token segments attended together: queries at ``rows`` over their own pages
    (``tables``, padded with page 0). Row j's keys are gathered positions
    ``[starts[j], lengths[j])`` of its table (``starts`` > 0 only inside a window)."""

    def __init__(
        self,
        rows: list[int],
        tables: np.ndarray,
        lengths: list[int],
        page: int,
        *,
        kernel: bool = False,
        starts: list[int] | None = None,
    ):
        self.rows = mx.array(rows, dtype=mx.int32)
        self.contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self.first = rows[0]
        self.tables = mx.array(tables)
        self.lengths = mx.array(lengths, dtype=mx.int32)
        self.longest = max(lengths)
        self.starts = mx.array(starts, dtype=mx.int32) if starts and any(starts) else None
        self.uniform = min(lengths) == self.longest and self.starts is None
        self.page = page
        self._mask: mx.array | None = None
        self._rows: dict[int, mx.array] = {}
        self._pages: dict[int, mx.array] = {}
        self.work = kernels.DecodeWork(lengths, tables.shape[1]) if kernel else None

    def head_rows(self, hkv: int) -> mx.array:
        """(2, B, Hkv, longest): each row's gathered keys and values in a float pool, head
        by head (``kv_quant.head_rows``), built once a step for all layers."""
        if hkv not in self._rows:
            self._rows[hkv] = table_head_rows(self.tables, self.page, self.longest, hkv)
        return self._rows[hkv]

    def page_rows(self, hkv: int) -> mx.array:
        """(2, B, Hkv, pages): each row's pages in a head-major pool, head by head
        (``kv_quant.take_head_pages``), built once a step for all layers."""
        if hkv not in self._pages:
            self._pages[hkv] = kv_quant.head_rows(self.tables, hkv)
        return self._pages[hkv]

    @property
    def mask(self) -> mx.array | None:
        """(B, 1, 1, longest) bool, None when every row reads all of its gathered keys."""
        if self._mask is None and not self.uniform:
            self._mask = key_mask(self.longest, self.lengths, self.starts)
        return self._mask

    def queries(self, queries: mx.array) -> mx.array:
        n = self.rows.shape[0]
        if self.contiguous and self.first == 0 and n == queries.shape[0]:
            return queries
        if self.contiguous:
            return queries[self.first : self.first + self.rows.shape[0]]
        return queries[self.rows]


@dataclass
class AttnView:
    """How paged layers of one window attend this step: decode groups, then chunks, and the
    permutation that puts their outputs back in token order."""

    decodes: list[DecodeGroup]
    chunks: list[ChunkItem]
    unpermute: mx.array | None
    kernel: bool


@dataclass
class DenseView:
    """Per token, its own history: ``slots`` (T, L) into the pool, ``mask`` of real ones
    (in the sequence layout: the chunk's keys, ``slots`` (1, L), and its (n, L) mask)."""

    slots: mx.array
    mask: mx.array


def slot(pages: tuple[int, ...], pos: int, p: int) -> int:
    """The pool slot of position ``pos`` in a table of pages of ``p``."""
    return pages[pos // p] * p + pos % p


def _slots(pages: tuple[int, ...], lo: int, hi: int, p: int) -> np.ndarray:
    """The pool slots of positions ``[lo, hi)`` (only the pages they are on are copied)."""
    pos = np.arange(lo, hi)
    first = lo // p
    table = np.asarray(pages[first : (hi - 1) // p + 1], dtype=np.int32)
    return table[pos // p - first] * p + (pos % p).astype(np.int32)


class StepContext:
    """Everything about a step's layout that every layer shares, built once from the plan.
    ``kernel``: full-attention decodes go to the paged decode kernel (one group, any
    lengths); otherwise they are grouped by length for the gather path. ``windowed``: the
    sliding-window layers' pools are the window group's (engine/kv_manager.py), addressed
    through each segment's ``wpages``."""

    def __init__(
        self,
        segments: tuple[Segment, ...] | list[Segment],
        page_size: int,
        *,
        kernel: bool = False,
        sequence: bool = False,
        windowed: bool = False,
    ) -> None:
        self.kernel = kernel
        self.windowed = windowed
        self.page_size = p = page_size
        self.segments = tuple(segments)
        # ``sequence``: the model is called on the segments as a (B, n) batch of sequences
        # (recurrent models' prefill chunks and verifies, all n tokens long), not on (T, 1)
        # single-token rows.
        self.sequence = sequence
        assert not sequence or len({s.num_tokens for s in self.segments}) == 1
        self._starts: mx.array | None = None
        positions: list[int] = []
        write_slots: list[int] = []
        window_slots: list[int] = []
        for seg in self.segments:
            if seg.num_tokens == 1:  # (a decode: no copy of its whole page table)
                pos = seg.start
                positions.append(pos)
                write_slots.append(slot(seg.pages, pos, p))
                if windowed:
                    assert seg.wpages, f"{seg.request_id}: no window page table"
                    window_slots.append(slot(seg.wpages, pos, p))
                continue
            positions.extend(range(seg.start, seg.end))
            write_slots.extend(_slots(seg.pages, seg.start, seg.end, p).tolist())
            if windowed:
                assert seg.wpages, f"{seg.request_id}: no window page table"
                window_slots.extend(_slots(seg.wpages, seg.start, seg.end, p).tolist())
        self.num_tokens = len(positions)
        self.positions = mx.array(positions, dtype=mx.int32)
        self.host_write_slots = np.asarray(write_slots, dtype=np.int32)
        self.write_slots = mx.array(self.host_write_slots)
        # Per page group (0: full, 1: window), host and device copies of the write slots.
        self.group_slots = [(self.host_write_slots, self.write_slots)]
        if windowed:
            host = np.asarray(window_slots, dtype=np.int32)
            self.group_slots.append((host, mx.array(host)))
        self._views: dict[tuple[int | None, bool], AttnView] = {}
        self._dense: dict[int | None, DenseView] = {}
        self.mask_rank = 4

    @property
    def starts(self) -> mx.array:
        """(B,) the first position of each sequence of the sequence layout (RoPE offsets)."""
        if self._starts is None:
            self._starts = mx.array([s.start for s in self.segments], dtype=mx.int32)
        return self._starts

    def _table(self, seg: Segment, window: int | None) -> tuple[int, ...]:
        """The page table a layer of ``window`` reads ``seg`` through."""
        return seg.wpages if self.windowed and window is not None else seg.pages

    def slots_for(self, window: int | None) -> mx.array:
        """Where a layer of ``window`` writes the step's tokens."""
        return self.group_slots[1 if self.windowed and window is not None else 0][1]

    def view(self, window: int | None, kernel: bool) -> AttnView:
        kernel = kernel and self.kernel and window is None
        key = (window, kernel)
        if key not in self._views:
            self._views[key] = self._build_view(window, kernel)
        return self._views[key]

    def _build_view(self, window: int | None, kernel: bool) -> AttnView:
        p = self.page_size
        decode_idx: list[int] = []  # token index of each single-token segment
        lengths: list[int] = []  # keys gathered per decode, from its first gathered page
        starts: list[int] = []  # first real key among them
        tables: list[tuple[int, ...]] = []
        chunks: list[ChunkItem] = []
        t = 0
        for seg in self.segments:
            if seg.num_tokens == 1 and window is None:  # the common row, without the loop
                end = seg.start + 1
                decode_idx.append(t)
                lengths.append(end)
                starts.append(0)
                tables.append(seg.pages[: -(-end // p)])
            elif seg.num_tokens == 1 or (kernel and seg.num_samples == seg.num_tokens):
                # A decode, or with the decode kernel a speculative verify segment: each of
                # its positions attends like a decode of its own (keys up to and including
                # it, already in the pool), in the kernel's one call with the step's decodes
                # instead of a gather and an SDPA of its own per layer (on the H200 a step
                # of 4 verifies cost 2.5x a decode step that way). The gather path keeps it
                # a chunk: one gather of its history, not one per position.
                for i, end in enumerate(range(seg.start + 1, seg.end + 1)):
                    lo = int(first_key(end - 1, window))
                    first_page = lo // p
                    decode_idx.append(t + i)
                    lengths.append(end - first_page * p)
                    starts.append(lo - first_page * p)
                    tables.append(self._table(seg, window)[first_page : -(-end // p)])
            else:
                chunks.append(self._chunk(seg, t, window))
            t += seg.num_tokens
        decodes: list[DecodeGroup] = []
        order: list[int] = []  # token indices in the order attention outputs come
        if decode_idx:
            groups = [list(range(len(decode_idx)))] if kernel else group_decodes(lengths)
            for group in groups:
                width = max(len(tables[i]) for i in group)
                table = np.zeros((len(group), width), dtype=np.int32)
                for j, i in enumerate(group):
                    table[j, : len(tables[i])] = tables[i]
                rows = [decode_idx[i] for i in group]
                order += rows
                decodes.append(
                    DecodeGroup(
                        rows,
                        table,
                        [lengths[i] for i in group],
                        p,
                        kernel=kernel,
                        starts=[starts[i] for i in group],
                    )
                )
        if BATCH_FRESH:
            chunks = batch_fresh(chunks)
        for c in chunks:
            order += c.token_rows()
        unpermute = (
            None
            if order == list(range(t))
            else mx.array(np.argsort(np.asarray(order, dtype=np.int64)).astype(np.int32))
        )
        return AttnView(decodes, chunks, unpermute, kernel)

    def _chunk(self, seg, first: int, window: int | None) -> ChunkItem:
        """Queries at positions [start, end) over keys [lo, end): all earlier positions, or
        the last ``window`` of each query's."""
        lo = int(first_key(seg.start, window))
        last = int(first_key(seg.end - 1, window))  # the last query's first key
        if seg.start == 0 and last == 0:
            return ChunkItem(first, seg.num_tokens, None)
        table = self._table(seg, window)
        p = self.page_size
        slots = None if seg.start == 0 else mx.array(_slots(table, lo, seg.end, p))
        pages = table[lo // p : (seg.end - 1) // p + 1]  # (what a head-major pool gathers)
        if last == lo:  # every query reads from the same first key: causal alone
            return ChunkItem(first, seg.num_tokens, slots, pages=pages, skip=lo % p)
        q = np.arange(seg.start, seg.end)[:, None]
        k = np.arange(lo, seg.end)[None]
        mask = mx.array((k <= q) & (k >= first_key(q, window)))
        return ChunkItem(first, seg.num_tokens, slots, mask, pages=pages, skip=lo % p)

    def dense(self, window: int | None) -> DenseView:
        """Per token: the pool slots of positions [lo, pos] of its own request (lo: 0, or
        the window's first), padded to the longest; the mask marks the real ones."""
        p = self.page_size
        if window not in self._dense and self.sequence:
            # Each (1, n) sequence: its request's keys [lo, end), padded to the longest, under
            # a causal (and windowed) mask: (n, L) for one sequence, else (B, 1, n, L) (or
            # (B, 1, 1, n, L) where the model's mask is of rank 5).
            segs = self.segments
            los = [int(first_key(s.start, window)) for s in segs]
            width = max(s.end - lo for s, lo in zip(segs, los, strict=True))
            n = segs[0].num_tokens
            slots = np.zeros((len(segs), width), dtype=np.int32)
            mask = np.zeros((len(segs), n, width), dtype=bool)
            for b, (seg, lo) in enumerate(zip(segs, los, strict=True)):
                q = np.arange(seg.start, seg.end)[:, None]
                k = np.arange(lo, seg.end)[None]
                m = (k <= q) & (k >= first_key(q, window))
                mask[b, :, : seg.end - lo] = m
                slots[b, : seg.end - lo] = _slots(self._table(seg, window), lo, seg.end, p)
            lead = (len(segs),) + (1,) * (self.mask_rank - 3)
            dense_mask = mask[0] if len(segs) == 1 else mask.reshape(*lead, n, width)
            self._dense[window] = DenseView(mx.array(slots), mx.array(dense_mask))
        if window not in self._dense:
            rows, counts = [], []
            for seg in self.segments:
                for pos in range(seg.start, seg.end):
                    lo = int(first_key(pos, window))
                    rows.append(_slots(self._table(seg, window), lo, pos + 1, p))
                    counts.append(pos + 1 - lo)
            width = max(counts)
            slots = np.zeros((len(rows), width), dtype=np.int32)
            for i, r in enumerate(rows):
                slots[i, : len(r)] = r
            mask = mx.arange(width)[None] < mx.array(counts, dtype=mx.int32)[:, None]
            shape = (len(rows),) + (1,) * (self.mask_rank - 2) + (width,)
            self._dense[window] = DenseView(mx.array(slots), mask.reshape(shape))
        return self._dense[window]
