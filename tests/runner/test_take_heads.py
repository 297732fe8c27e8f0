"""Float pools are gathered head by head (``kv_quant.take_heads``): the same keys and values
as gathering whole positions and transposing them, already in SDPA's layout."""

from __future__ import annotations

import mlx.core as mx

from tandem.runner import kv_quant
from tandem.runner.step_context import table_head_rows


def test_take_heads_matches_positions() -> None:
    page, hkv, d = 4, 2, 32
    pool = mx.random.normal((40, 2 * hkv, d))
    tables = mx.array([[3, 7, 1], [9, 0, 0]], dtype=mx.int32)
    longest = 10  # a cut inside the third page
    x = kv_quant.take_pages(pool, tables, page, longest)  # (B, L, 2 Hkv, D)
    k, v = kv_quant.take_heads(pool, table_head_rows(tables, page, longest, hkv))
    assert k.shape == v.shape == (2, hkv, longest, d)
    assert mx.array_equal(k, x[:, :, :hkv].transpose(0, 2, 1, 3)).item()
    assert mx.array_equal(v, x[:, :, hkv:].transpose(0, 2, 1, 3)).item()
    slots = mx.array([5, 29, 30, 2], dtype=mx.int32)  # a chunk's keys
    k, v = kv_quant.take_heads(pool, kv_quant.head_rows(slots, hkv))
    y = pool[slots]
    assert mx.array_equal(k, y[:, :hkv].transpose(1, 0, 2)).item()
    assert mx.array_equal(v, y[:, hkv:].transpose(1, 0, 2)).item()
