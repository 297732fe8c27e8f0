"""The paged KV pool and the per-step context every layer shares.

Per layer, K and V live in one buffer of ``num_pages * page_size`` slots shaped
``(slots, 2 * kv_heads, head_dim)``, allocated once at start; slot ``page * page_size + i`` holds
position ``i`` of whatever page ``page`` stands for in a request's page table. A step writes its
new tokens' K/V with one scatter per layer, at slots computed once per step.

Two steps in flight on the CPU backend: MLX decides at submission whether a scatter may write
its input buffer in place, and a buffer that the in-flight step still reads is not donatable,
so the write would copy the whole buffer (every layer, every step). With ``double_buffer`` the
pool keeps two buffer sets and alternates between them step by step: a step writes only into
its own set and first replays the writes the other set received since (the previous step's
tokens). That costs 2x KV memory and one extra small scatter per layer, against a full copy.

The cache objects speak mlx-lm's cache protocol (``offset``, ``update_and_fetch``,
``make_mask``), so unmodified mlx-lm model code drives them; attention itself is in
``runner.attention`` (the seam at mlx-lm's ``scaled_dot_product_attention``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tandem.engine.plan import StepPlan
from tandem.runner import kernels


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size


class PagePool:
    """Owns the per-layer buffers. Pages are assigned by the scheduler, not here.

    One buffer per layer holds both K and V: ``(slots, 2 * kv_heads, head_dim)``, K in the
    first ``kv_heads`` rows of a slot and V in the rest, so a step writes each layer with one
    scatter (on the CPU backend a scatter's fixed cost dominated four small ones)."""

    def __init__(
        self, shape: KVShape, num_pages: int, page_size: int, *, double_buffer: bool
    ) -> None:
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_sets = 2 if double_buffer else 1
        self.sets: list[list[mx.array]] = []
        self.current = 0
        # This step's writes (host slots, device slots, K/V entries per layer), which the
        # other set replays next step, and the previous step's, merged into this one's.
        self._step: tuple[np.ndarray, mx.array, list[mx.array]] | None = None
        self._lag: tuple[mx.array, list[mx.array]] | None = None
        self._keep: mx.array | None = None
        self.reset()

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        return self.num_sets * self.shape.bytes_per_token

    def reset(self) -> None:
        """(Re)create every buffer: all KV is gone (after a failure, nothing in flight). The
        old buffers are released first, so the new ones fit where they were."""
        self.sets = []
        self._step = self._lag = self._keep = None
        gc.collect()
        mx.clear_cache()
        s = self.shape
        for _ in range(self.num_sets):
            bufs = []
            for _ in range(s.num_layers):
                buf = mx.zeros((self.num_slots, 2 * s.num_kv_heads, s.head_dim), dtype=s.dtype)
                mx.eval(buf)
                bufs.append(buf)
            self.sets.append(bufs)
        self.current = 0
        self._step = self._lag = self._keep = None

    def begin_step(self, slots: np.ndarray, device_slots: mx.array) -> None:
        """Start a step that writes ``slots`` (host and device copies): switch to the other
        buffer set, which owes the previous step's writes. Those are replayed with this
        step's own, in one scatter per layer, except where this step overwrites the same slot
        (a page freed and handed out again after a chain break): MLX leaves the order of
        duplicate scatter indices undefined, so the stale entries are dropped."""
        if self.num_sets == 1:
            return
        self.current ^= 1
        lag, self._lag = self._step, None
        self._step = (slots, device_slots, [])
        self._keep = None
        if lag is not None:
            lag_host, lag_dev, lag_vals = lag
            stale = np.isin(lag_host, slots)
            if stale.any():
                self._keep = mx.array(np.flatnonzero(~stale).astype(np.int32))
                lag_dev = lag_dev[self._keep]
            self._lag = (mx.concatenate([lag_dev, device_slots]), lag_vals)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Scatter (N, kv_heads, D) keys and values at ``slots`` (N,) of the current set, with
        the previous step's writes the set missed."""
        vals = mx.concatenate([keys, values], axis=1)
        buf = self.sets[self.current]
        if self.num_sets > 1:
            self._step[2].append(vals)
            if self._lag is not None:
                merged, lag_vals = self._lag
                old = lag_vals[layer] if self._keep is None else lag_vals[layer][self._keep]
                buf[layer][merged] = mx.concatenate([old, vals])
                return
        buf[layer][slots] = vals

    def layer(self, layer: int) -> mx.array:
        return self.sets[self.current][layer]

    def arrays(self) -> list[mx.array]:
        return list(self.sets[self.current])


MAX_PADDING = 0.25  # padded key slots allowed per batched decode group


class DecodeGroup:
    """Single-token segments attended together: queries at ``rows`` over their own pages
    (``tables``, padded with page 0) up to ``lengths``."""

    def __init__(
        self,
        rows: list[int],
        tables: np.ndarray,
        lengths: list[int],
        page: int,
        *,
        kernel: bool = False,
    ):
        self.rows = mx.array(rows, dtype=mx.int32)
        self.contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self.first = rows[0]
        self.tables = mx.array(tables)
        self.lengths = mx.array(lengths, dtype=mx.int32)
        self.longest = max(lengths)
        self.uniform = min(lengths) == self.longest
        self.page = page
        self._mask: mx.array | None = None
        self.work = kernels.DecodeWork(lengths) if kernel else None

    @property
    def mask(self) -> mx.array | None:
        """(B, 1, 1, longest) bool, None when every length is the longest."""
        if self._mask is None and not self.uniform:
            cols = mx.arange(self.longest, dtype=mx.int32)[None]
            self._mask = (cols < self.lengths[:, None])[:, None, None, :]
        return self._mask

    def queries(self, queries: mx.array) -> mx.array:
        if self.contiguous:
            return queries[self.first : self.first + self.rows.shape[0]]
        return queries[self.rows]


@dataclass
class ChunkItem:
    """A multi-token segment: queries ``[first, first + n)`` over positions ``[0, end)``."""

    first: int
    n: int
    slots: mx.array | None  # (end,), None when the chunk starts at 0 (it attends to itself)


def group_decodes(lengths: list[int]) -> list[list[int]]:
    """Indices into ``lengths`` grouped so padding to each group's longest wastes at most
    ~MAX_PADDING of the group's real key slots."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if groups:
            g = groups[-1]
            longest = lengths[g[0]]
            if longest * (len(g) + 1) <= (1 + MAX_PADDING) * (real + n):
                g.append(i)
                real += n
                continue
        groups.append([i])
        real = n
    return groups


class StepContext:
    """Everything about a step's layout that every layer shares, built once from the plan.
    ``kernel``: decodes go to the paged decode kernel (one group, any lengths); otherwise
    they are grouped by length for the gather path."""

    def __init__(self, plan: StepPlan, pool: PagePool, *, kernel: bool = False) -> None:
        self.pool = pool
        self.kernel = kernel
        p = pool.page_size
        positions: list[int] = []
        write_slots: list[int] = []
        decode_idx: list[int] = []  # token index of each single-token segment
        decode_lengths: list[int] = []
        decode_pages: list[tuple[int, ...]] = []
        self.chunks: list[ChunkItem] = []
        order: list[int] = []  # token indices in the order attention outputs come
        t = 0
        for seg in plan.segments:
            positions.extend(range(seg.start, seg.end))
            if seg.num_tokens == 1:
                pos = seg.start
                write_slots.append(seg.pages[pos // p] * p + pos % p)
                decode_idx.append(t)
                decode_lengths.append(seg.end)
                decode_pages.append(seg.pages)
            else:
                # Only a chunk's own pages: never the whole table of a long request.
                pages = np.asarray(seg.pages[: -(-seg.end // p)], dtype=np.int32)
                slots = (pages[:, None] * p + np.arange(p, dtype=np.int32)[None]).reshape(-1)
                write_slots.extend(slots[seg.start : seg.end].tolist())
                kv = None if seg.start == 0 else mx.array(slots[: seg.end])
                self.chunks.append(ChunkItem(t, seg.num_tokens, kv))
            t += seg.num_tokens
        self.num_tokens = t
        self.positions = mx.array(positions, dtype=mx.int32)
        self.host_write_slots = np.asarray(write_slots, dtype=np.int32)
        self.write_slots = mx.array(self.host_write_slots)
        self.decodes: list[DecodeGroup] = []
        if decode_idx:
            groups = [list(range(len(decode_idx)))] if kernel else group_decodes(decode_lengths)
            for group in groups:
                lengths = [decode_lengths[i] for i in group]
                width = -(-max(lengths) // p)
                tables = np.zeros((len(group), width), dtype=np.int32)
                for j, i in enumerate(group):
                    used = decode_pages[i][: -(-lengths[j] // p)]
                    tables[j, : len(used)] = used
                rows = [decode_idx[i] for i in group]
                order += rows
                self.decodes.append(DecodeGroup(rows, tables, lengths, p, kernel=kernel))
        for c in self.chunks:
            order += range(c.first, c.first + c.n)
        # Attention outputs come group by group; this puts them back in token order.
        self.unpermute = (
            None
            if order == list(range(t))
            else mx.array(np.argsort(np.asarray(order, dtype=np.int64)).astype(np.int32))
        )


class PagedCache:
    """One layer's view of a step (mlx-lm's cache protocol): RoPE offsets per token, the
    scatter of the new K/V into the pool; attention reads the pool through ``ctx``."""

    def __init__(self, ctx: StepContext, layer: int) -> None:
        self.ctx, self.layer = ctx, layer

    @property
    def offset(self) -> mx.array:
        return self.ctx.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys: (T, kv_heads, 1, D) — one token per batch entry.
        k, v = keys[:, :, 0, :], values[:, :, 0, :]
        self.ctx.pool.write(self.layer, self.ctx.write_slots, k, v)
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("sliding-window attention is not supported yet")
        assert n == 1, "a paged step feeds one token per batch entry"
        return None

    @property
    def state(self) -> mx.array:
        return self.ctx.pool.layer(self.layer)
