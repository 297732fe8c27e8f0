"""KV storage: one dense buffer per layer for K and V, ``(rows * kv_heads, capacity, head_dim)``.

Layout choice (docs/kv_layout.md has the measurement): each running request owns one row for
its whole life. A decode step writes one position per row *in place* (a scatter that MLX
donates, so no buffer copy) and attends over ``rows[:R, :, :L]`` — a view, never a gather —
with a per-row length mask. Nothing is re-padded or moved when requests join or leave.
Buffers grow (rarely: rows in steps of 8, capacity in 256-token chunks) and that growth is the
only copy.

The cache objects speak mlx-lm's cache protocol (``offset``, ``update_and_fetch``,
``make_mask``, ``state``) so unmodified mlx-lm model code drives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

ROW_STEP = 8


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size


class KVPool:
    """Owns the per-layer buffers. Rows are assigned by the scheduler, not here."""

    def __init__(self, shape: KVShape, max_rows: int) -> None:
        self.shape = shape
        self.max_rows = max_rows
        self.num_rows = 0
        self.capacity = 0
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self._row_index: dict[int, mx.array] = {}

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.capacity * self.shape.bytes_per_token

    def ensure(self, num_rows: int, capacity: int) -> None:
        """Grow (lazily, as graph ops) so rows < num_rows and positions < capacity fit."""
        if num_rows <= self.num_rows and capacity <= self.capacity:
            return
        rows = min(self.max_rows, max(self.num_rows, -(-num_rows // ROW_STEP) * ROW_STEP))
        cap = max(self.capacity, capacity)
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        for store in (self.keys, self.values):
            for i in range(self.shape.num_layers):
                new = mx.zeros((rows * h, cap, d), dtype=self.shape.dtype)
                if self.num_rows:
                    new[: self.num_rows * h, : self.capacity, :] = store[i]
                if i < len(store):
                    store[i] = new
                else:
                    store.append(new)
        self.num_rows, self.capacity = rows, cap

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def row_caches(self, row: int, start: int) -> list[RowCache]:
        return [RowCache(self, i, row, start) for i in range(self.shape.num_layers)]

    def batch_caches(
        self, num_rows: int, positions: mx.array, length: int, *, ragged: bool
    ) -> list[BatchCache]:
        """Caches for a decode forward over rows 0..num_rows-1. ``ragged`` is False when every
        row writes the same position: then all ``length`` keys are valid and no mask is built."""
        h = self.shape.num_kv_heads
        index = self._row_index.get(num_rows)
        if index is None:
            index = self._row_index[num_rows] = mx.arange(num_rows * h, dtype=mx.int32)
        ctx = BatchContext(num_rows, positions, length, h, ragged, index)
        return [BatchCache(self, i, ctx) for i in range(self.shape.num_layers)]


class RowCache:
    """One row, one layer: a prefill chunk written at ``start`` (mlx-lm KVCache semantics)."""

    def __init__(self, pool: KVPool, layer: int, row: int, start: int) -> None:
        self.pool, self.layer, self.row = pool, layer, row
        self.offset = start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        h = self.pool.shape.num_kv_heads
        r0, r1 = self.row * h, (self.row + 1) * h
        s, n = self.offset, keys.shape[2]
        self.offset += n
        k_buf, v_buf = self.pool.keys[self.layer], self.pool.values[self.layer]
        k_buf[r0:r1, s : s + n, :] = keys[0]
        v_buf[r0:r1, s : s + n, :] = values[0]
        return k_buf[None, r0:r1, : s + n, :], v_buf[None, r0:r1, : s + n, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("sliding-window attention is not supported")
        if n == 1:
            return None
        if return_array:
            q = mx.arange(self.offset, self.offset + n)[:, None]
            return q >= mx.arange(self.offset + n)[None]
        return "causal"

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.pool.keys[self.layer], self.pool.values[self.layer]


@dataclass
class BatchContext:
    """Shared by every layer of one decode forward."""

    num_rows: int
    positions: mx.array  # (R,) int32: the position each row writes this step
    length: int  # attend over [0, length)
    num_kv_heads: int
    ragged: bool
    row_index: mx.array  # arange(num_rows * num_kv_heads)
    _mask: mx.array | None = None
    _write_pos: mx.array | None = None

    @property
    def mask(self) -> mx.array | None:
        if self._mask is None and self.ragged:
            cols = mx.arange(self.length, dtype=mx.int32)
            self._mask = (cols[None] <= self.positions[:, None])[:, None, None, :]
        return self._mask

    @property
    def flat_rows(self) -> tuple[mx.array, mx.array]:
        """(row*heads + head, position) index pairs for the scatter."""
        if self._write_pos is None:
            self._write_pos = mx.repeat(self.positions, self.num_kv_heads)
        return self.row_index, self._write_pos


class BatchCache:
    """Rows 0..R-1 of one layer, one new token each, at per-row positions."""

    def __init__(self, pool: KVPool, layer: int, ctx: BatchContext) -> None:
        self.pool, self.layer, self.ctx = pool, layer, ctx

    @property
    def offset(self) -> mx.array:
        return self.ctx.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        ctx, pool = self.ctx, self.pool
        r, h, d = ctx.num_rows, ctx.num_kv_heads, pool.shape.head_dim
        idx, pos = ctx.flat_rows
        k_buf, v_buf = pool.keys[self.layer], pool.values[self.layer]
        # In-place scatter of one position per (row, head); see the module docstring.
        k_buf[idx, pos] = keys.reshape(r * h, d)
        v_buf[idx, pos] = values.reshape(r * h, d)
        shape = (pool.num_rows, h, pool.capacity, d)
        k = k_buf.reshape(shape)[:r, :, : ctx.length, :]
        v = v_buf.reshape(shape)[:r, :, : ctx.length, :]
        return k, v

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("sliding-window attention is not supported")
        assert n == 1
        return self.ctx.mask

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.pool.keys[self.layer], self.pool.values[self.layer]
