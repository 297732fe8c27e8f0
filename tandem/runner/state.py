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
"""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from tandem.runner.layers import StateSpec


class StatePool:
    def __init__(self, specs: list[StateSpec], num_slots: int) -> None:
        self.specs = specs
        self.num_slots = num_slots
        self.bufs: list[list[mx.array | None]] = []
        self.reset()

    def reset(self) -> None:
        self.bufs = []
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

    @property
    def bytes(self) -> int:
        return self.num_slots * sum(s.bytes_per_seq for s in self.specs)

    def arrays(self) -> list[mx.array]:
        return [b for layer in self.bufs for b in layer if b is not None]


class StepState(ArraysCache):
    """One recurrent layer's cache for one model call of a step: the states of its rows
    gathered from ``read`` slots (None: the call's sequences start at 0 and read nothing, as
    mlx-lm's empty cache). ``write_back`` stores what the layer left in the cache to the
    rows' ``write`` slots, and rows ``copies[0]`` also to snapshot slots ``copies[1]``."""

    def __init__(
        self,
        pool: StatePool,
        layer: int,
        write: mx.array,
        read: mx.array | None,
        copies: tuple[mx.array, mx.array] | None = None,
    ) -> None:
        bufs = pool.bufs[layer]
        super().__init__(len(bufs))
        self.pool, self.layer, self.write, self.copies = pool, layer, write, copies
        if read is not None:
            for k, buf in enumerate(bufs):
                if buf is None:
                    continue
                self.cache[k] = buf[read]

    def write_back(self) -> None:
        bufs = self.pool.bufs[self.layer]
        for k, buf in enumerate(bufs):
            new = self.cache[k]
            if buf is None or new is None:
                continue
            new = new.astype(buf.dtype)
            buf[self.write] = new
            if self.copies is not None:
                rows, slots = self.copies
                buf[slots] = new[rows]
