"""Recurrent state (linear attention, SSM, short convolutions) in per-request slots.

A recurrent layer keeps a fixed-size state per sequence (mlx-lm's ``ArraysCache``: e.g. a
convolution window and a gated-delta or SSM state). The pool holds, per layer and per array,
one buffer of ``num_slots`` states, allocated once; the scheduler gives each running request
a slot. A step gathers the states of the rows it runs, the unmodified mlx-lm layer advances
them, and the new states are scattered back to the same slots — only for the requests in the
step, so a request that is not in it never advances. A sequence that starts at position 0
reads no state (mlx-lm's own empty cache). Slots past the running ones keep snapshots for
the prefix cache: a step copies a state there at a page boundary, and a request resuming
from a cached prefix reads its first state from one.

Decode steps that run the same rows in the same order as the step before (the steady state
of a batch) skip both: the previous step's new states stay *resident* as they came out of the
layer, are read from there, and reach the pool only when the rows change (``flush``, before
anything else of that step reads or writes a slot). On MLX's CPU backend the scatter of 16
rows of a 256 KiB state costs ~6.6 ms, more than a small model's whole step.

A verify's states after each position (runner/positions.py) are *held* the same way: the
arrays the layers produced stay as they are, ids past the pool's slots point into them, and
a read of such an id takes its state from there (a rejected proposal's resume reads one of
K); the engine's plans say which ids it freed, and their states are let go. Scattered to the
pool instead, 4 verifies of K = 4 cost a Qwen3.5 tiny shape's CPU step 40% more.
"""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from tandem.runner import kv_write
from tandem.runner import positions as _positions
from tandem.runner.layers import StateSpec


class Held:
    """One call's states after each position: per layer and array, m arrays (B, ...); and
    per position the rows whose ids still hold it (a position's arrays go with its last)."""

    def __init__(self, specs: list[StateSpec], rows: list[list[int]]) -> None:
        self.values: list[list[list[mx.array | None] | None]] = [
            [None] * len(s.entries) for s in specs
        ]
        m = max((len(r) for r in rows), default=0)
        self.holders = [{r for r, row in enumerate(rows) if j < len(row)} for j in range(m)]

    def release(self, r: int, j: int) -> None:
        self.holders[j].discard(r)
        if not self.holders[j]:
            for layer in self.values:
                for per in layer:
                    if per is not None:
                        per[j] = None


class Reads:
    """The slots (or held ids) a call's rows read their states from, in row order."""

    def __init__(self, pool: StatePool, slots: list[int]) -> None:
        self.slots = slots
        self.held = any(s in pool.held for s in slots)
        assert self.held or all(0 <= s < pool.num_slots for s in slots), f"no state in {slots}"
        self.idx = None if self.held else mx.array(slots, dtype=mx.int32)


class StatePool:
    """The state buffers: per layer and array, one of ``num_slots`` states.

    ``inplace`` (None or True: where ``runner.kv_write``'s kernels pass their check, i.e.
    MLX's CUDA backend, as for the KV pool; False: MLX's scatter and gather): states are
    stored by ``kv_write``'s kernel into the buffers, which are never replaced, and read by
    its gather after the last store (each buffer's stores form one chain, as a KV layer's
    do). MLX's scatter and gather take the whole buffer, and snapshot slots make a buffer up
    to a gigabyte: on CUDA a whole-buffer input closes a graph (``kv_write.handle``), and a
    scatter into a buffer the step before still reads copies it first (``kv_write``'s
    module notes). A read's rows depend on the stores before it; a store into a slot read
    earlier in the same step depends on that read only through its values, which is how
    the engine uses slots (a row's new state is made from its own read; snapshot and backup
    slots are fresh)."""

    def __init__(
        self, specs: list[StateSpec], num_slots: int, inplace: bool | None = False
    ) -> None:
        self.specs = specs
        self.num_slots = max(1, num_slots)
        dtypes = {e[1] for s in specs for e in s.entries if e is not None}
        self.inplace = inplace is not False and all(kv_write.available(t) for t in dtypes)
        self.bufs: list[list[mx.array | None]] = []
        # In place: each buffer as (num_slots, state size) rows, and its last store's token.
        self.flat: list[list[mx.array | None]] = []
        self.tokens: list[list[mx.array | None]] = []
        # The last decode call's rows (their slots, in order) and new states per layer and
        # array, not yet written to ``bufs``.
        self.resident: tuple[tuple[int, ...], list[list[mx.array | None] | None]] | None = None
        # Slots whose state is held: (the call's states, row, position); and the calls
        # whose held states no step has evaluated yet.
        self.held: dict[int, tuple[Held, int, int]] = {}
        self._new: list[Held] = []
        self.reset()

    def release(self) -> None:
        """Let go of the buffers and every state made from them (before the pools are
        allocated again, after a failure: ``reset``)."""
        self.bufs, self.flat, self.tokens = [], [], []
        self.resident = None
        self.held = {}
        self._new = []

    def reset(self) -> None:
        self.release()
        gc.collect()
        mx.clear_cache()
        for spec in self.specs:
            layer = []
            for e in spec.entries:
                buf = None if e is None else mx.zeros((self.num_slots, *e[0]), dtype=e[1])
                if buf is not None:
                    mx.eval(buf)
                layer.append(buf)
            self.bufs.append(layer)
            flat = self.inplace  # (views would keep scattered-over buffers alive)
            self.flat.append(
                [b.reshape(self.num_slots, -1) if flat and b is not None else None for b in layer]
            )
            self.tokens.append([None] * len(layer))
        mx.eval([f for layer in self.flat for f in layer if f is not None])

    def take(self, layer: int, k: int, idx: mx.array) -> mx.array:
        """Array ``k`` of ``layer`` at slots ``idx`` (n,): (n, ...)."""
        buf, token = self.bufs[layer][k], self.tokens[layer][k]
        assert buf is not None
        if token is None:
            return buf[idx]
        flat = self.flat[layer][k]
        assert flat is not None
        return kv_write.gather(flat, idx, token).reshape(*idx.shape, *buf.shape[1:])

    def put(self, layer: int, k: int, idx: mx.array, values: mx.array) -> None:
        """Store ``values`` (n, ...) as array ``k`` of ``layer`` at slots ``idx`` (n,)."""
        buf = self.bufs[layer][k]
        assert buf is not None
        if not self.inplace:
            buf[idx] = values
            return
        flat = self.flat[layer][k]
        assert flat is not None
        n = idx.shape[0]
        token = self.tokens[layer][k]
        self.tokens[layer][k] = kv_write.write(flat, idx, values.reshape(n, -1), None, token)

    @property
    def bytes(self) -> int:
        return self.num_slots * sum(s.bytes_per_seq for s in self.specs)

    def arrays(self) -> list[mx.array]:
        """What a step evaluates with its outputs: the buffers, the resident states, and the
        states held since the last call (later steps only read those)."""
        held = [x for x in self.resident[1] if x is not None] if self.resident is not None else []
        kept = [x for h in self._new for layer in h.values for v in layer or () for x in v or ()]
        kept = [x for x in kept if x is not None]
        self._new = []
        bufs = [b for layer in [*self.bufs, *held, *self.tokens] for b in layer if b is not None]
        return bufs + kept

    def hold(self, rows: list[list[int]]) -> Held:
        """Ids ``rows[r][j]`` (past the pool's slots: engine/state_slots.py's PositionSlots)
        hold row r's states after position j of the call to come."""
        held = Held(self.specs, rows)
        self._new.append(held)
        for r, row in enumerate(rows):
            for j, slot in enumerate(row):
                self.held[slot] = (held, r, j)
        return held

    def forget(self, slots: tuple[int, ...]) -> None:
        """Let go of the states these ids held (the engine freed them)."""
        for slot in slots:
            entry = self.held.pop(slot, None)
            if entry is not None:
                held, r, j = entry
                held.release(r, j)

    def gather(self, layer: int, k: int, reads: Reads) -> mx.array:
        """Array ``k`` of ``layer`` for these slots, (len(slots), ...)."""
        if reads.idx is not None:
            return self.take(layer, k, reads.idx)
        parts = []
        for s in reads.slots:
            if s in self.held:
                held, r, j = self.held[s]
                value = held.values[layer][k]
                state = None if value is None else value[j]
                assert state is not None, f"slot {s}: no state held for layer {layer}"
                parts.append(state[r])
            else:
                assert s < self.num_slots, f"slot {s} holds no state"
                parts.append(self.take(layer, k, mx.array([s], dtype=mx.int32))[0])
        return mx.stack(parts)

    def flush(self) -> None:
        """Write the resident states to their slots."""
        if self.resident is None:
            return
        slots, states = self.resident
        self.resident = None
        idx = mx.array(slots, dtype=mx.int32)
        for layer, (bufs, news) in enumerate(zip(self.bufs, states, strict=True)):
            for k, (buf, new) in enumerate(zip(bufs, news or [None] * len(bufs), strict=True)):
                if buf is not None and new is not None:
                    self.put(layer, k, idx, new)


class StepState(ArraysCache):
    """One recurrent layer's cache for one model call of a step: the states of its rows
    gathered from ``read`` slots (None: the call's sequences start at 0 and read nothing, as
    mlx-lm's empty cache), or given (``initial``: the pool's resident states of exactly these
    rows). ``write_back`` stores what the layer left in the cache to the rows' ``write``
    slots, or into ``keep`` (to become the resident states), and rows ``copies[0]`` also to
    snapshot slots ``copies[1]``. ``backup``: slots that get a copy of the states read.
    ``positions``: where each row's states after the call's first m positions are held
    (``StatePool.hold``; runner/positions.py: the layer's calls capture them as it runs)."""

    def __init__(
        self,
        pool: StatePool,
        layer: int,
        write: mx.array | None,
        read: Reads | None,
        copies: tuple[mx.array, mx.array] | None = None,
        *,
        initial: list[mx.array | None] | None = None,
        keep: list[list[mx.array | None] | None] | None = None,
        backup: mx.array | None = None,
        positions: tuple[Held, int] | None = None,
    ) -> None:
        bufs = pool.bufs[layer]
        super().__init__(len(bufs))
        self.pool, self.layer, self.write, self.copies, self.keep = pool, layer, write, copies, keep
        self.positions = positions
        self.capture = _positions.Capture() if positions is not None else None
        if initial is not None:
            self.cache = list(initial)
        elif read is not None:
            for k, buf in enumerate(bufs):
                if buf is None:
                    continue
                self.cache[k] = pool.gather(layer, k, read)
                if backup is not None:
                    pool.put(layer, k, backup, self.cache[k])

    def __getitem__(self, idx):
        _positions.aim(self.capture)  # (a layer reads its cache before it runs)
        return self.cache[idx]

    def write_back(self) -> None:
        _positions.aim(None)
        bufs = self.pool.bufs[self.layer]
        kept: list[mx.array | None] = []
        for k, buf in enumerate(bufs):
            new = self.cache[k]
            if buf is None or new is None:
                kept.append(None)
                continue
            new = new.astype(buf.dtype)
            kept.append(new)
            if self.keep is None:
                assert self.write is not None, "states neither kept nor written"
                self.pool.put(self.layer, k, self.write, new)
            if self.copies is not None:
                rows, slots = self.copies
                self.pool.put(self.layer, k, slots, new[rows])
            if self.positions is not None:
                assert self.capture is not None
                held, m = self.positions
                per = self.capture.per_position(self.cache[k], m)
                held.values[self.layer][k] = [v.astype(buf.dtype) for v in per]
        if self.keep is not None:
            self.keep[self.layer] = kept


# Compiled decode steps (runner/static_decode.py) of a model with recurrent layers: a step
# whose rows' states are all resident takes them as inputs of the trace and hands back the
# next ones, which stay resident; the pool's slots are not touched, as in the uncompiled
# step it stands for.


def steady(pool: StatePool | None, segments) -> bool:
    """Whether these single-token rows' states are all resident (the rows of the decode
    step before, in its order) and the step reads, keeps and copies nothing else: none
    starts a sequence, reads another slot or takes a snapshot. Always, without states."""
    if pool is None:
        return True
    return (
        pool.resident is not None
        and pool.resident[0] == tuple(s.state_slot for s in segments)
        and all(
            s.start > 0 and s.state_src < 0 and s.state_backup < 0 and not s.snapshots
            for s in segments
        )
    )


def _flat(layers: list[list[mx.array | None] | None]) -> list[mx.array]:
    return [x for layer in layers for x in layer or () if x is not None]


def _shaped(pool: StatePool, values) -> list[list[mx.array | None] | None]:
    """``values`` (an iterator, in ``_flat`` order) laid out as the resident states are."""
    assert pool.resident is not None
    return [
        None if layer is None else [None if x is None else next(values) for x in layer]
        for layer in pool.resident[1]
    ]


def resident_inputs(pool: StatePool) -> list[mx.array]:
    """The resident states, layer by layer and array by array (a compiled step's inputs)."""
    assert pool.resident is not None
    return _flat(pool.resident[1])


def resident_caches(pool: StatePool, initial: tuple[mx.array, ...], keep: list) -> list[StepState]:
    """Inside a trace: each recurrent layer's cache given its rows' states ``initial`` (in
    ``resident_inputs``' order), keeping the next ones in ``keep``."""
    keep[:] = [None] * len(pool.specs)
    return [
        StepState(pool, j, None, None, initial=init, keep=keep)
        for j, init in enumerate(_shaped(pool, iter(initial)))
    ]


def kept_outputs(keep: list) -> list[mx.array]:
    """The states a traced step kept, in ``resident_inputs``' order (its last outputs)."""
    return _flat(keep)


def make_resident(pool: StatePool, segments, new: list[mx.array]) -> None:
    """After a compiled step: its rows' next states ``new`` become the resident ones."""
    given = iter(new)
    states = _shaped(pool, given)
    assert next(given, None) is None, "a compiled step kept more states than it read"
    pool.resident = (tuple(s.state_slot for s in segments), states)
