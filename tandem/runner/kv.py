"""KV storage: per layer, dense K and V buffers shaped ``(rows * kv_heads, capacity, head_dim)``.

Layout (docs/design.md has the measurements): each running request owns one row for its whole
life. A decode step writes one position per row with a scatter that MLX performs in place, and
attends over ``rows[:R, :, :L]`` — a view, never a gather — with a per-row length mask.
Nothing is re-padded or moved when requests join or leave; buffers only grow (rows in steps of
8, capacity in 256-token chunks), and that growth is the only copy.

Two steps in flight: MLX keeps every input of a launched kernel alive until it has run, so a
write into a buffer that the in-flight step still reads cannot be done in place — MLX copies
the whole buffer instead (every layer, every step). With ``double_buffer`` the pool keeps two
buffer sets and alternates between them step by step: a step writes only into its own set,
which the in-flight step does not touch, and first replays the writes the other set received
since (its "lag": the previous step's token, or its prefill chunks). That costs 2x KV memory
and one extra small scatter per layer, against a full KV copy per layer per step.

The cache objects speak mlx-lm's cache protocol (``offset``, ``update_and_fetch``,
``make_mask``, ``state``) so unmodified mlx-lm model code drives them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from tandem.engine.plan import KVOutOfMemory

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


@dataclass(frozen=True)
class _Write:
    """One layer's write, replayed into the other buffer set: either a slab — flat rows
    ``flat_row0 ..`` (row * kv_heads + head) at positions ``start ..`` — or a scatter at
    (``index``, ``positions``)."""

    keys: mx.array  # slab: (flat rows, n, D); scatter: (N, D)
    values: mx.array
    flat_row0: int = 0
    start: int = 0
    index: mx.array | None = None
    positions: mx.array | None = None


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    text = str(e).lower()
    return "out of memory" in text or "alloc" in text  # malloc, unable to allocate, ...


class KVPool:
    """Owns the per-layer buffers. Rows are assigned by the scheduler, not here."""

    def __init__(
        self, shape: KVShape, max_rows: int, *, double_buffer: bool, row_step: int = ROW_STEP
    ) -> None:
        self.shape = shape
        self.max_rows = max_rows
        self.row_step = row_step
        self.num_rows = 0
        self.capacity = 0
        self.num_sets = 2 if double_buffer else 1
        # sets[s] = (keys per layer, values per layer)
        self.sets: list[tuple[list[mx.array], list[mx.array]]] = [
            ([], []) for _ in range(self.num_sets)
        ]
        self.current = 0
        self._lag: list[list[list[_Write]]] = [
            [[] for _ in range(shape.num_layers)] for _ in range(self.num_sets)
        ]
        self._row_index: dict[int, mx.array] = {}

    @property
    def bytes_per_token(self) -> int:
        return self.num_sets * self.shape.bytes_per_token

    def begin_step(self, num_rows: int, capacity: int) -> None:
        """Switch to the other buffer set, replay its lag (now both sets hold the same KV),
        then reallocate if the step needs more rows or positions."""
        self.current = (self.current + 1) % self.num_sets
        for layer, writes in enumerate(self._lag[self.current]):
            if not writes:
                continue
            k_buf, v_buf = self.layer_buffers(layer)
            for w in writes:
                self._apply(k_buf, v_buf, w)
            writes.clear()
        self._ensure(num_rows, capacity)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy positions ``[0, length)`` of row ``src`` into row ``dst`` (a prefix hit on a
        row another request owns): one slice copy and one in-place slice write per layer.
        The source slices are evaluated first (blocking; copies only come in fresh steps,
        when nothing is in flight): a write into a buffer that a pending slice still
        references makes MLX copy the whole buffer (measured: 2 s vs 5 ms at 4 GiB)."""
        h = self.shape.num_kv_heads
        s0 = src * h
        parts = []
        for layer in range(self.shape.num_layers):
            k_buf, v_buf = self.layer_buffers(layer)
            parts.append(
                (
                    k_buf[s0 : s0 + h, :length, :] * 1,
                    v_buf[s0 : s0 + h, :length, :] * 1,
                )
            )
        with self._oom_resets(wanted=self.num_rows * self.capacity):
            mx.eval(parts)
        for layer, (keys, values) in enumerate(parts):
            self._write(layer, _Write(keys, values, flat_row0=dst * h, start=0))

    def arrays(self) -> list[mx.array]:
        keys, values = self.sets[self.current]
        return keys + values

    def _ensure(self, num_rows: int, capacity: int) -> None:
        """Grow to hold ``num_rows`` rows of ``capacity`` positions. Growing the capacity
        reallocates anyway, so it also drops rows past ``num_rows`` (the scheduler keeps its
        KV budget by retracting the top rows before it grows the capacity)."""
        rows = min(self.max_rows, -(-num_rows // self.row_step) * self.row_step)
        if rows <= self.num_rows and capacity <= self.capacity:
            return
        cap = max(self.capacity, capacity)
        if cap == self.capacity:
            rows = max(rows, self.num_rows)
        with self._oom_resets(wanted=rows * cap):
            self._grow(rows, cap)

    @contextlib.contextmanager
    def _oom_resets(self, wanted: int) -> Iterator[None]:
        """An allocation failure inside empties the pool (it may be half grown; the
        scheduler then retracts everything) and becomes KVOutOfMemory."""
        try:
            yield
        except (RuntimeError, MemoryError) as e:
            if not _is_oom(e):
                raise
            held = self.num_rows * self.capacity
            self.reset()
            raise KVOutOfMemory(held, wanted, str(e)) from None

    def reset(self) -> None:
        """Free every buffer (nothing may be in flight)."""
        for keys, values in self.sets:
            keys.clear()
            values.clear()
        for lag in self._lag:
            for writes in lag:
                writes.clear()
        self.num_rows = self.capacity = 0
        mx.clear_cache()

    def _grow(self, rows: int, cap: int) -> None:
        keep = min(rows, self.num_rows)
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        for keys, values in self.sets:
            for store in (keys, values):
                for i in range(self.shape.num_layers):
                    new = mx.zeros((rows * h, cap, d), dtype=self.shape.dtype)
                    if keep:
                        new[: keep * h, : self.capacity, :] = store[i][: keep * h]
                    # One layer at a time, so the old and new buffers of all layers are never
                    # alive together (growth only happens in fresh steps: nothing in flight).
                    mx.eval(new)
                    if i < len(store):
                        store[i] = new
                    else:
                        store.append(new)
        self.num_rows, self.capacity = rows, cap
        mx.clear_cache()  # the old buffers' memory goes back to the device, not MLX's cache

    def _record(self, layer: int, write: _Write) -> None:
        for s in range(self.num_sets):
            if s != self.current:
                self._lag[s][layer].append(write)

    @staticmethod
    def _apply(k_buf: mx.array, v_buf: mx.array, w: _Write) -> None:
        """An in-place slice write (the cheapest write MLX has) or a scatter."""
        if w.index is None:
            f, n = w.keys.shape[0], w.keys.shape[1]
            k_buf[w.flat_row0 : w.flat_row0 + f, w.start : w.start + n, :] = w.keys
            v_buf[w.flat_row0 : w.flat_row0 + f, w.start : w.start + n, :] = w.values
        else:
            k_buf[w.index, w.positions] = w.keys
            v_buf[w.index, w.positions] = w.values

    def _write(self, layer: int, w: _Write) -> None:
        """Write into the current set; the other set replays it next step."""
        self._apply(*self.layer_buffers(layer), w)
        self._record(layer, w)

    def write_chunk(
        self, layer: int, row: int, start: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write (H, n, D) at ``start`` of ``row``; returns the row's (1, H, start+n, D) views."""
        h, n = self.shape.num_kv_heads, keys.shape[1]
        r0 = row * h
        self._write(layer, _Write(keys, values, flat_row0=r0, start=start))
        k_buf, v_buf = self.layer_buffers(layer)
        return k_buf[None, r0 : r0 + h, : start + n, :], v_buf[None, r0 : r0 + h, : start + n, :]

    def write_rows(
        self, layer: int, ctx: BatchContext, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write one (R*H, D) position per row; returns (R, H, length, D) views. When every
        row is at the same position this is one slice write, else one scatter."""
        if ctx.uniform_position is not None:
            self._write(
                layer,
                _Write(keys[:, None, :], values[:, None, :], start=ctx.uniform_position),
            )
        else:
            self.write_scatter(layer, ctx.row_index, ctx.write_positions, keys, values)
        k_buf, v_buf = self.layer_buffers(layer)
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        shape = (self.num_rows, h, self.capacity, d)
        r, n = ctx.num_rows, ctx.length
        return k_buf.reshape(shape)[:r, :, :n, :], v_buf.reshape(shape)[:r, :, :n, :]

    def write_scatter(
        self, layer: int, index: mx.array, positions: mx.array, keys: mx.array, values: mx.array
    ) -> None:
        """Write (N, D) entries at flat (row*heads+head, position) pairs."""
        self._write(layer, _Write(keys, values, index=index, positions=positions))

    def layer_buffers(self, layer: int) -> tuple[mx.array, mx.array]:
        keys, values = self.sets[self.current]
        return keys[layer], values[layer]

    def first_chunk_caches(self, rows: list[int], length: int) -> list[FirstChunkCache]:
        """Caches for one forward over several prompts' first chunks, right-padded to
        ``length``: they attend only to themselves, so the row buffers are written, not read.
        Padding writes land at positions the row has not reached yet (later overwritten)."""
        h = self.shape.num_kv_heads
        row_heads = mx.array([r * h + i for r in rows for i in range(h)], dtype=mx.int32)
        index = mx.repeat(row_heads, length)
        positions = mx.tile(mx.arange(length, dtype=mx.int32), len(rows) * h)
        return [FirstChunkCache(self, i, index, positions) for i in range(self.shape.num_layers)]

    def row_caches(self, row: int, start: int) -> list[RowCache]:
        return [RowCache(self, i, row, start) for i in range(self.shape.num_layers)]

    def batch_caches(self, positions: tuple[int, ...], array: mx.array | None) -> list[BatchCache]:
        """Caches for a decode forward over rows 0..len(positions)-1; ``array`` is
        ``positions`` on the device when the caller already has it."""
        ctx = BatchContext(self.shape.num_kv_heads, positions, array, self._row_index)
        return [BatchCache(self, i, ctx) for i in range(self.shape.num_layers)]


def causal_mask(offset: int, n: int, return_array: bool, window_size: int | None):
    """mlx-lm's mask for n new tokens after ``offset`` cached ones (as its KVCache gives)."""
    if window_size is not None:
        raise ValueError("sliding-window attention is not supported")
    if n == 1:
        return None
    if return_array:
        return mx.arange(offset, offset + n)[:, None] >= mx.arange(offset + n)[None]
    return "causal"


class RowCache:
    """One row, one layer: a prefill chunk written at ``start`` (mlx-lm KVCache semantics)."""

    def __init__(self, pool: KVPool, layer: int, row: int, start: int) -> None:
        self.pool, self.layer, self.row = pool, layer, row
        self.offset = start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.offset
        self.offset += keys.shape[2]
        return self.pool.write_chunk(self.layer, self.row, start, keys[0], values[0])

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return causal_mask(self.offset, n, return_array, window_size)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.pool.layer_buffers(self.layer)


class FirstChunkCache:
    """One layer of a batched first-chunk prefill (positions 0..T-1 of several rows)."""

    offset = 0

    def __init__(self, pool: KVPool, layer: int, index: mx.array, positions: mx.array) -> None:
        self.pool, self.layer, self.index, self.positions = pool, layer, index, positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        d = keys.shape[-1]
        self.pool.write_scatter(
            self.layer, self.index, self.positions, keys.reshape(-1, d), values.reshape(-1, d)
        )
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return causal_mask(self.offset, n, return_array, window_size)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.pool.layer_buffers(self.layer)


class BatchContext:
    """Shared by every layer of one decode forward. When all rows are at one position (always
    at batch 1) writes are a slice, RoPE takes an int offset and no mask is built."""

    def __init__(
        self,
        num_kv_heads: int,
        positions: tuple[int, ...],
        array: mx.array | None,
        index_cache: dict[int, mx.array],
    ) -> None:
        self.num_rows = len(positions)
        self.num_kv_heads = num_kv_heads
        self.length = max(positions) + 1  # attend over [0, length)
        first = positions[0]
        self.uniform_position = first if all(p == first for p in positions) else None
        self._host_positions = positions
        self._positions = array
        self._index_cache = index_cache
        self._mask: mx.array | None = None
        self._write_positions: mx.array | None = None

    @property
    def positions(self) -> mx.array:
        if self._positions is None:
            self._positions = mx.array(self._host_positions, dtype=mx.int32)
        return self._positions

    @property
    def offset(self) -> int | mx.array:
        return self.uniform_position if self.uniform_position is not None else self.positions

    @property
    def mask(self) -> mx.array | None:
        if self._mask is None and self.uniform_position is None:
            cols = mx.arange(self.length, dtype=mx.int32)
            self._mask = (cols[None] <= self.positions[:, None])[:, None, None, :]
        return self._mask

    @property
    def row_index(self) -> mx.array:
        """arange(R * kv_heads): the flat (row, head) index of the scatter."""
        n = self.num_rows * self.num_kv_heads
        if n not in self._index_cache:
            self._index_cache[n] = mx.arange(n, dtype=mx.int32)
        return self._index_cache[n]

    @property
    def write_positions(self) -> mx.array:
        if self._write_positions is None:
            self._write_positions = mx.repeat(self.positions, self.num_kv_heads)
        return self._write_positions


class BatchCache:
    """Rows 0..R-1 of one layer, one new token each, at per-row positions."""

    def __init__(self, pool: KVPool, layer: int, ctx: BatchContext) -> None:
        self.pool, self.layer, self.ctx = pool, layer, ctx

    @property
    def offset(self) -> int | mx.array:
        return self.ctx.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rh = self.ctx.num_rows * self.pool.shape.num_kv_heads
        d = self.pool.shape.head_dim
        return self.pool.write_rows(
            self.layer, self.ctx, keys.reshape(rh, d), values.reshape(rh, d)
        )

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise ValueError("sliding-window attention is not supported")
        assert n == 1
        return self.ctx.mask

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.pool.layer_buffers(self.layer)
