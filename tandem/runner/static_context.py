"""What a compiled decode step's layers read (runner/static_decode.py): ``StaticContext``
plays ``StepContext``'s role for the trace, over one ``StaticGroup`` of every row and one
per sliding window or chunk, all built from the trace's input arrays (no host values)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx

from tandem.runner import kv_quant
from tandem.runner.step_context import (
    AttnView,
    DenseView,
    key_mask,
    table_head_rows,
    table_slots,
)


class StaticGroup:
    """The step's one decode group (``step_context.DecodeGroup``'s role): every row, in
    order, over its page table. The gather path reads whole tables under a mask."""

    def __init__(
        self,
        tables: mx.array,
        lengths: mx.array,
        work: SimpleNamespace | None,
        page: int,
        starts: mx.array | None = None,
    ) -> None:
        self.tables, self.lengths, self.work, self.page = tables, lengths, work, page
        self.starts = starts  # a window's (or chunk's) first key in each row's table
        self.longest = tables.shape[1] * page
        self._mask: mx.array | None = None
        self._rows: dict[int, mx.array] = {}
        self._pages: dict[int, mx.array] = {}

    def head_rows(self, hkv: int) -> mx.array:
        if hkv not in self._rows:
            self._rows[hkv] = table_head_rows(self.tables, self.page, self.longest, hkv)
        return self._rows[hkv]

    def page_rows(self, hkv: int) -> mx.array:
        """(2, B, Hkv, pages): each row's pages in a head-major pool, head by head."""
        if hkv not in self._pages:
            self._pages[hkv] = kv_quant.head_rows(self.tables, hkv)
        return self._pages[hkv]

    @property
    def mask(self) -> mx.array:
        """Gathers read whole tables under this mask (also with the kernel on: layers with
        attention sinks); built only where one reads it."""
        if self._mask is None:
            self._mask = key_mask(self.longest, self.lengths, self.starts)
        return self._mask

    def queries(self, queries: mx.array) -> mx.array:
        return queries


class StaticContext:
    """What ``PagedCache`` and the attention seam read of a step (``StepContext``'s role)."""

    sequence = False

    def __init__(
        self,
        positions,
        write_slots,
        group: StaticGroup,
        kernel: bool,
        window_slots,
        spans: dict[int, StaticGroup],
        mask_rank: int,
    ) -> None:
        self.positions, self.write_slots, self.window_slots = positions, write_slots, window_slots
        self.mask_rank = mask_rank
        self._view = AttnView([group], [], None, kernel)
        self._plain = AttnView([group], [], None, False)
        # Sliding windows and chunks read through the gather path, as uncompiled steps do.
        self._spans = {span: AttnView([g], [], None, False) for span, g in spans.items()}
        self._groups = {None: group, **spans}
        self._dense: dict[int | None, DenseView] = {}

    def dense(self, span: int | None) -> DenseView:
        """A dense layer's history (``StepContext.dense``): each row's whole table, in
        position order, under its group's mask, whose rank is the model's."""
        if span not in self._dense:
            g = self._groups[span]
            slots = table_slots(g.tables, g.page)
            m, n = slots.shape
            shape = (m,) + (1,) * (self.mask_rank - 2) + (n,)
            self._dense[span] = DenseView(slots, g.mask.reshape(shape))
        return self._dense[span]

    def view(self, span: int | None, kernel: bool) -> AttnView:
        if span is not None:
            return self._spans[span]
        return self._view if kernel else self._plain

    def slots_for(self, window: int | None) -> mx.array:
        return self.write_slots if window is None else self.window_slots
