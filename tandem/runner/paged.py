"""The paged KV pool and the cache objects every layer's attention goes through.

Per layer, K and V live in one buffer of ``num_pages * page_size`` slots, allocated once at
start; slot ``page * page_size + i`` holds position ``i`` of whatever page ``page`` stands for
in a request's page table. A paged layer's buffer is ``(slots, 2 * kv_heads, head_dim)``, K in
the first ``kv_heads`` rows of a slot and V in the rest (what the decode kernel reads), or
with ``head_major`` (the CPU) ``(pages, 2 * kv_heads, page_size, head_dim)``: the same
entries, each head's page one contiguous run for the gather path to read whole; a dense
layer's (``runner.layers``) is ``(slots, width)``, K and V flattened side by side, whatever
their shapes (MLA latents). A step writes its new tokens' K/V with one scatter per layer, at
slots computed once per step.

Two steps in flight on the CPU backend: MLX decides at submission whether a scatter may write
its input buffer in place, and a buffer that the in-flight step still reads is not donatable,
so the write would copy the whole buffer (every layer, every step). With ``double_buffer`` the
pool keeps two buffer sets and alternates between them step by step: a step writes only into
its own set and first replays the writes the other set received since (the previous step's
tokens). That costs 2x KV memory and one extra small scatter per layer, against a full copy.
On MLX's CUDA backend the copy is avoided in place instead (``inplace``, ``runner.kv_write``):
a kernel stores the new entries into the one buffer set, and the step's reads of a layer
take that layer's write token.

The cache objects speak mlx-lm's cache protocol (``offset``, ``update_and_fetch``,
``make_mask``), so unmodified mlx-lm model code drives them; paged attention itself is in
``runner.attention`` (the seam at mlx-lm's ``scaled_dot_product_attention``).
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np

from tandem.runner import kv_owners, kv_quant, kv_write
from tandem.runner.kv_quant import Buffer, KVQuant, QuantizedPages
from tandem.runner.layers import GRAPH_BOOKKEEPING, Bookkeeping, LayerSpec
from tandem.runner.step_context import StepContext


class PagePool:
    """Owns the per-layer buffers. Pages are assigned by the scheduler, not here."""

    def __init__(
        self,
        specs: list[LayerSpec],
        num_pages: int,
        page_size: int,
        *,
        double_buffer: bool,
        quant: KVQuant | None = None,
        inplace: bool = False,
        window_pages: int = 0,
        head_major: bool = False,
    ) -> None:
        """``head_major``: float pages of attention layers laid out (pages, 2 Hkv, page, D),
        each head's page one run (read by ``kv_quant.take_head_pages``); else (slots, 2 Hkv,
        D), position by position, as the decode kernel and the in-place writes take it."""
        self.specs = specs
        # Sliding-window layers in a page group of their own (engine/kv_manager.py), with
        # ``window_pages`` pages (0: none, every layer has ``num_pages``).
        self.window_pages = window_pages
        self.group = [int(bool(window_pages) and s.window is not None) for s in specs]
        self.inplace = inplace and not double_buffer
        self.head_major = head_major and not self.inplace
        # Per page group, the last write slots a head-major write split into pages and
        # offsets (every layer of the group writes at the same slots in a step).
        self._split: list[tuple[mx.array, mx.array, mx.array] | None] = [None, None]
        # In place: each layer's latest write token, which its reads wait on; it depends on
        # every earlier write of the layer (a chain, evaluated with each submission). A
        # compiled step (runner/static_decode.py) takes them and hands back its own.
        self.tokens: list[mx.array | None] = [None] * len(specs)
        self.quant = quant
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_sets = 2 if double_buffer else 1
        self.sets: list[list[Buffer]] = []
        self.current = 0
        # This step's writes (host slots, device slots, each layer's encoded K/V entries),
        # which the other set replays next step, and the previous step's, merged into this
        # one's.
        # (Per page group: a step's writes are at each group's own slots.)
        self._step: list[tuple[np.ndarray, mx.array, dict[int, list[mx.array]]] | None]
        self._step = [None, None]
        self._lag: list[tuple[mx.array, dict[int, list[mx.array]]] | None] = [None, None]
        self._keep: list[mx.array | None] = [None, None]
        # The slots of the previous step's writes this step replays (without its own).
        self._lag_slots: list[mx.array | None] = [None, None]
        self.reset()

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def quantized(self, layer: int) -> bool:
        return quantizable(self.specs[layer], self.quant)

    def release(self) -> None:
        """Let go of every buffer and every pending write made from them (the caller collects
        and clears MLX's cache)."""
        self.sets = []
        self._step, self._lag, self._keep = [None, None], [None, None], [None, None]
        self._lag_slots = [None, None]
        self.tokens = [None] * len(self.specs)
        self._split = [None, None]

    def reset(self) -> None:
        """(Re)create every buffer: all KV is gone (after a failure, nothing in flight). The
        old buffers are released first, so the new ones fit where they were."""
        self.release()
        gc.collect()
        mx.clear_cache()
        for _ in range(self.num_sets):
            bufs = []
            for i, s in enumerate(self.specs):
                entry = _entry(s)
                # One page more than any table names: slot -1 (the last row) is where the
                # padding rows of a compiled step write (runner/static_decode.py).
                pages = self.window_pages if self.group[i] else self.num_pages
                rows = 1 if s.unused else (pages + 1) * self.page_size
                buf: Buffer
                if self.quantized(i):
                    assert self.quant is not None
                    buf = QuantizedPages(rows, entry, s.dtype, self.quant)
                elif self.head_major and not (s.unused or s.dense):
                    buf = mx.zeros((pages + 1, entry[0], self.page_size, entry[1]), s.dtype)
                else:
                    buf = mx.zeros((rows, *entry), dtype=s.dtype)
                mx.eval(*kv_quant.parts(buf))
                bufs.append(buf)
            self.sets.append(bufs)
        self.current = 0

    def begin_step(self, group_slots: list[tuple[np.ndarray, mx.array]]) -> None:
        """Start a step that writes, per page group, its slots (host and device copies):
        switch to the other buffer set, which owes the previous step's writes. Those are
        replayed with this step's own, in one scatter per layer, except where this step
        overwrites the same slot (a page freed and handed out again after a chain break):
        MLX leaves the order of duplicate scatter indices undefined, so the stale entries
        are dropped."""
        if self.num_sets == 1:
            # In place, a layer's writes stay chained across steps (each takes the last
            # one's token): what a submission evaluates covers every write since the last
            # one, also those of forwards nothing read (a draft's catch-up chunk).
            return
        self.current ^= 1
        for g, (slots, device_slots) in enumerate(group_slots):
            lag, self._lag[g], self._lag_slots[g] = self._step[g], None, None
            self._step[g] = (slots, device_slots, {})
            self._keep[g] = None
            if lag is not None:
                lag_host, lag_dev, lag_vals = lag
                stale = np.isin(lag_host, slots)
                if stale.any():
                    keep = mx.array(np.flatnonzero(~stale).astype(np.int32))
                    self._keep[g] = keep
                    lag_dev = lag_dev[keep]
                self._lag[g] = (mx.concatenate([lag_dev, device_slots]), lag_vals)
                self._lag_slots[g] = lag_dev

    def step_state(self) -> tuple:
        """What ``begin_step`` changes (``restore_step`` puts it back)."""
        return self.current, *(
            list(x) for x in (self._step, self._lag, self._keep, self._lag_slots)
        )

    def restore_step(self, state: tuple) -> None:
        """(After a compiled step's trace: its write slots' split, tracers, goes too.)"""
        self.current, self._step, self._lag, self._keep, self._lag_slots = state
        self._split = [None, None]

    def pending(self) -> int:
        """With two buffer sets: the most writes of one page group that the next step's set
        will replay (the last step's)."""
        return max((len(st[0]) for st in self._step if st is not None), default=0)

    def lag(self, g: int, layer: int) -> tuple[mx.array, list[mx.array]] | None:
        """What this step replays into ``layer`` (of page group ``g``) of its set: the
        previous step's slots and encoded entries, stale ones dropped (None: nothing)."""
        slots = self._lag_slots[g]
        if self._lag[g] is None or slots is None:
            return None
        return slots, self._missed(g, layer)

    def _missed(self, g: int, layer: int) -> list[mx.array]:
        """The previous step's encoded entries of ``layer`` that this set missed, those a
        later write made stale dropped (``_keep``)."""
        lag, keep = self._lag[g], self._keep[g]
        assert lag is not None
        old = lag[1][layer]
        return old if keep is None else [o[keep] for o in old]

    def replay_into(self, g: int, slots: mx.array, lag: dict[int, mx.array]) -> None:
        """Inside a compiled step: the previous step's writes to replay are the trace's
        inputs ``lag`` (per layer) at ``slots``, and this step's writes are recorded afresh
        (``written``)."""
        self._step[g] = (None, None, {})
        self._keep[g] = None
        self._lag[g] = (slots, {layer: [v] for layer, v in lag.items()})

    def written(self, g: int) -> dict[int, list[mx.array]]:
        """The entries this step wrote per layer of page group ``g`` (double buffering)."""
        step = self._step[g]
        assert step is not None
        return step[2]

    def record(self, g: int, layer: int, encoded: list[mx.array]) -> None:
        """Set what the other set replays of ``layer`` next step (a compiled step's own
        writes, cut to its real rows)."""
        step = self._step[g]
        assert step is not None
        step[2][layer] = encoded

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Scatter (N, heads, dim) keys and values at ``slots`` (N,) of the current set, with
        the previous step's writes the set missed. In place, keys and values may keep a
        singleton axis ((N, heads, 1, dim): the same rows)."""
        if self.inplace:
            self._write_inplace(layer, slots, keys, values)
            return
        if self.specs[layer].dense:
            n = keys.shape[0]
            vals = mx.concatenate([keys.reshape(n, -1), values.reshape(n, -1)], axis=1)
        else:
            vals = mx.concatenate([keys, values], axis=1)
        buf = self.sets[self.current][layer]
        encoded = buf.encode(vals) if isinstance(buf, QuantizedPages) else [vals]
        at = slots
        if self.num_sets > 1:
            g = self.group[layer]
            step, lag = self._step[g], self._lag[g]
            assert step is not None
            step[2][layer] = encoded
            if lag is not None:
                old = self._missed(g, layer)
                encoded = [mx.concatenate([o, e]) for o, e in zip(old, encoded, strict=True)]
                at = lag[0]  # (the previous step's slots and this step's)
        if isinstance(buf, mx.array) and buf.ndim == 4:  # head-major: (page, all heads, offset)
            g = self.group[layer]
            split = self._split[g]
            if split is None or split[0] is not at:  # (once a step, for all its layers)
                split = self._split[g] = (at, at // self.page_size, at % self.page_size)
            buf[split[1], :, split[2]] = encoded[0]
            return
        for part, e in zip(kv_quant.parts(buf), encoded, strict=True):
            part[at] = e

    def _write_inplace(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array):
        buf = self.sets[0][layer]
        token = self.tokens[layer]
        if isinstance(buf, QuantizedPages):
            n = keys.shape[0]
            vals = mx.concatenate([keys.reshape(n, -1), values.reshape(n, -1)], axis=1)
            for part, e in zip(buf.parts(), buf.encode(vals), strict=True):
                token = kv_write.write(part, slots, e, None, token)
        else:
            token = kv_write.write(buf, slots, keys, values, token)
        self.tokens[layer] = token

    def layer(self, layer: int) -> Buffer:
        return self.sets[self.current][layer]

    def token(self, layer: int) -> mx.array | None:
        """What a read of ``layer`` waits on (None: no in-place write to wait on)."""
        return self.tokens[layer]

    def arrays(self) -> list[mx.array]:
        """What a step's submission must include for its writes to happen."""
        if self.inplace:
            return [t for t in self.tokens if t is not None]
        return [a for buf in self.sets[self.current] for a in kv_quant.parts(buf)]


def flat_tokens(x: mx.array) -> mx.array:
    """(B, heads, n, D) sequences as (B n, heads, D) tokens, sequence by sequence."""
    b, h, n, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * n, h, d)


class PagedCache:
    """One layer's view of a step (mlx-lm's cache protocol): RoPE offsets per token and the
    scatter of the new K/V into the pool. A paged layer's attention reads the pool through
    ``ctx`` at the seam; a dense layer gets each token's gathered history back from
    ``update_and_fetch`` and the mask of its real positions from ``make_mask``."""

    def __init__(self, ctx: StepContext, pool: PagePool, layer: int) -> None:
        self.ctx, self.pool, self.layer = ctx, pool, layer
        self.spec = pool.specs[layer]
        self._last: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> mx.array | int:
        if self.ctx.sequence:
            segs = self.ctx.segments
            return segs[0].start if len(segs) == 1 else self.ctx.starts
        return self.ctx.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys: (T, kv_heads, 1, D) — one token per batch entry — or (B, kv_heads, n, D) in
        # the sequence layout.
        if self.ctx.sequence:
            k, v = flat_tokens(keys), flat_tokens(values)
        elif self.pool.inplace:  # the kernel reads (T, heads, 1, D) as (T, heads, D) rows
            k, v = keys, values
        else:
            k, v = keys[:, :, 0, :], values[:, :, 0, :]
        self.pool.write(self.layer, self.ctx.slots_for(self.spec.window), k, v)
        if not self.spec.dense:
            return self._returned(keys, values)
        s = self.spec
        view = self.ctx.dense(s.span)
        t, width = view.slots.shape
        x = kv_quant.take(self.pool.layer(self.layer), view.slots, self.token)  # (T, L, width)
        split = s.k_heads * s.k_dim
        k = x[..., :split].reshape(t, width, s.k_heads, s.k_dim).transpose(0, 2, 1, 3)
        v = x[..., split:].reshape(t, width, s.v_heads, s.v_dim).transpose(0, 2, 1, 3)
        return self._returned(k, v)

    def _returned(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._last = (keys, values)
        kv_owners.stored(keys, values, self)
        return keys, values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last ``update_and_fetch`` returned: a layer sharing this one's KV
        (gemma3n) attends with it and this cache, which the seam reads as this layer's."""
        if self._last is None:
            raise AttributeError("the cache has stored nothing yet")
        return self._last

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """None for paged layers (each knows its window); for a model with dense layers, the
        real positions of each token's gathered history (the window asked for, else this
        layer's): the model hands it to the layers that share it."""
        assert n == 1 or self.ctx.sequence, "a paged step feeds one token per batch entry"
        if not any(s.dense for s in self.pool.specs):
            return None
        return self.ctx.dense(window_size or self.spec.span).mask

    @property
    def state(self) -> Buffer:
        return self.pool.layer(self.layer)

    @property
    def token(self) -> mx.array | None:
        return self.pool.token(self.layer)


class BookkeepingCache(PagedCache, Bookkeeping):
    """A GRAPH_BOOKKEEPING model's cache (runner/layers.py): the pool is the store and its
    writes are part of every step's evaluation, so reads of ``keys``/``values`` give what
    ``update_and_fetch`` returned and assignments are dropped."""


def cache_class(model_type: str) -> type[PagedCache]:
    return BookkeepingCache if model_type in GRAPH_BOOKKEEPING else PagedCache


def _entry(spec: LayerSpec) -> tuple[int, ...]:
    return (spec.width,) if spec.dense else (spec.k_heads + spec.v_heads, spec.k_dim)


def quantizable(spec: LayerSpec, quant: KVQuant | None) -> bool:
    """Whether the layer's pages are quantized: some group size divides its entries."""
    return quant is not None and not spec.unused and quant.group_for(_entry(spec)) is not None


def bytes_per_token(spec: LayerSpec, quant: KVQuant | None) -> int:
    """Pool bytes one position costs in this layer (rounded up)."""
    if not quantizable(spec, quant):
        return spec.bytes_per_token
    assert quant is not None
    return quant.bytes_per_slot(_entry(spec), spec.dtype)
