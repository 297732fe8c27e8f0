"""Which cache returned which keys, in the model call running now.

A layer's attention does not always read the keys its own cache returned: gemma3n and gemma4
layers share an earlier layer's KV (handed over with that layer's cache, or with none at all),
and iquestloopcoder's second loop attends over the first loop's keys while passing its own
windowed cache. Paged attention must read the pool of the layer that *stored* the keys, with
that layer's window, so every cache records what it returns here, by identity, and the seam
(``runner.attention``) looks the keys up. Entries hold their arrays, so an id cannot be
reused while it is listed; ``forward()`` clears them around each model call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx

_STORED: dict[int, tuple[mx.array, mx.array, object]] = {}
_DEPTH = [0]


@contextlib.contextmanager
def forward() -> Iterator[None]:
    """One model call: the keys each cache returns are attributed to it until it ends.
    Model calls do not nest (a nested one would clear the outer call's entries)."""
    assert _DEPTH[0] == 0, "model calls nested"
    _DEPTH[0] += 1
    _STORED.clear()
    try:
        yield
    finally:
        _STORED.clear()
        _DEPTH[0] -= 1


def stored(keys: mx.array, values: mx.array, cache: object) -> None:
    """``cache`` returned ``keys`` and ``values`` to its layer."""
    _STORED[id(keys)] = (keys, values, cache)


def owner(keys: mx.array, values: mx.array) -> object | None:
    """The cache that returned exactly these keys and values in this call, if any."""
    entry = _STORED.get(id(keys))
    if entry is None or entry[0] is not keys or entry[1] is not values:
        return None
    return entry[2]
