"""The paged KV pool and the per-step context every layer shares.

Per layer, K and V live in one buffer of ``num_pages * page_size`` slots shaped
``(slots, kv_heads, head_dim)``, allocated once at start; slot ``page * page_size + i`` holds
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

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tandem.engine.plan import StepPlan


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
    """Owns the per-layer buffers. Pages are assigned by the scheduler, not here."""

    def __init__(
        self, shape: KVShape, num_pages: int, page_size: int, *, double_buffer: bool
    ) -> None:
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_sets = 2 if double_buffer else 1
        self.sets: list[tuple[list[mx.array], list[mx.array]]] = []
        self.current = 0
        # Writes the other set still has to replay: (slots, keys, values) per layer.
        self._lag: list[list[tuple[mx.array, mx.array, mx.array]]] = []
        self.reset()

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        return self.num_sets * self.shape.bytes_per_token

    def reset(self) -> None:
        """(Re)create every buffer: all KV is gone (after a failure, nothing in flight)."""
        self.sets = []
        mx.clear_cache()
        s = self.shape
        for _ in range(self.num_sets):
            keys, values = [], []
            for _ in range(s.num_layers):
                for store in (keys, values):
                    buf = mx.zeros((self.num_slots, s.num_kv_heads, s.head_dim), dtype=s.dtype)
                    mx.eval(buf)
                    store.append(buf)
            self.sets.append((keys, values))
        self.current = 0
        self._lag = [[] for _ in range(s.num_layers)]

    def begin_step(self) -> None:
        """Switch to the other buffer set and replay the writes it missed."""
        if self.num_sets == 1:
            return
        self.current ^= 1
        keys, values = self.sets[self.current]
        for layer, writes in enumerate(self._lag):
            for slots, k, v in writes:
                keys[layer][slots] = k
                values[layer][slots] = v
        self._lag = [[] for _ in range(self.shape.num_layers)]

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Scatter (N, kv_heads, D) entries at ``slots`` (N,) of the current set."""
        k_buf, v_buf = self.sets[self.current][0], self.sets[self.current][1]
        k_buf[layer][slots] = keys
        v_buf[layer][slots] = values
        if self.num_sets > 1:
            self._lag[layer].append((slots, keys, values))

    def layer(self, layer: int) -> tuple[mx.array, mx.array]:
        keys, values = self.sets[self.current]
        return keys[layer], values[layer]

    def arrays(self) -> list[mx.array]:
        keys, values = self.sets[self.current]
        return keys + values


MAX_PADDING = 0.25  # padded key slots allowed per batched decode group


@dataclass
class DecodeGroup:
    """Single-token segments attended together: queries at ``rows`` over their slots padded
    to the group's longest (masked past each one's length)."""

    rows: mx.array  # (B,) token indices in the step
    slots: mx.array  # (B, L)
    mask: mx.array | None  # (B, 1, 1, L) bool, None when every length is L


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
    """Everything about a step's layout that every layer shares, built once from the plan."""

    def __init__(self, plan: StepPlan, pool: PagePool) -> None:
        self.pool = pool
        p = pool.page_size
        positions: list[int] = []
        write_slots: list[int] = []
        decode_idx: list[int] = []  # token index of each single-token segment
        decode_slots: list[np.ndarray] = []
        self.chunks: list[ChunkItem] = []
        order: list[int] = []  # token indices in the order attention outputs come
        t = 0
        for seg in plan.segments:
            pages = np.asarray(seg.pages, dtype=np.int32)
            slots = (pages[:, None] * p + np.arange(p, dtype=np.int32)[None]).reshape(-1)
            positions.extend(range(seg.start, seg.end))
            write_slots.extend(slots[seg.start : seg.end].tolist())
            if seg.num_tokens == 1:
                decode_idx.append(t)
                decode_slots.append(slots[: seg.end])
            else:
                kv = None if seg.start == 0 else mx.array(slots[: seg.end])
                self.chunks.append(ChunkItem(t, seg.num_tokens, kv))
            t += seg.num_tokens
        self.num_tokens = t
        self.positions = mx.array(positions, dtype=mx.int32)
        self.write_slots = mx.array(write_slots, dtype=mx.int32)
        self.decodes: list[DecodeGroup] = []
        for group in group_decodes([len(s) for s in decode_slots]):
            lengths = [len(decode_slots[i]) for i in group]
            longest = lengths[0]
            padded = np.zeros((len(group), longest), dtype=np.int32)
            for j, i in enumerate(group):
                padded[j, : lengths[j]] = decode_slots[i]
            mask = None
            if lengths[-1] != longest:
                cols = np.arange(longest)[None]
                mask = mx.array((cols < np.asarray(lengths)[:, None])[:, None, None, :])
            rows = [decode_idx[i] for i in group]
            order += rows
            self.decodes.append(DecodeGroup(mx.array(rows, dtype=mx.int32), mx.array(padded), mask))
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
    def state(self) -> tuple[mx.array, mx.array]:
        return self.ctx.pool.layer(self.layer)
