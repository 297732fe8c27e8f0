"""Gathered decode attention on MLX's CPU: whole positions gathered through the page tables
and each half's transpose copied contiguous (Tandem before 2026-12-05), against keys and
values gathered head by head straight into SDPA's layout from a position-major pool
(runner/kv_quant.take_heads, one index per position and head), and from a head-major pool
(kv_quant.take_head_pages, one index per page and head: the CPU's layout since 2026-12-07).
Outputs are checked equal; medians of 15 evaluations each, in turn.

    python scripts/cpu_gather_probe.py
"""

from __future__ import annotations

import time

import tandem.runner  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx


def bench(b: int, n: int, hkv: int, h: int, d: int, p: int = 16, dtype=mx.float32) -> None:
    per_row = -(-n // p)  # pages; a length not a whole number of them is cut (a view)
    slots = b * per_row * p + 4 * p
    pool = mx.random.normal((slots, 2 * hkv, d)).astype(dtype)
    tables = mx.array([[b_ * per_row + i for i in range(per_row)] for b_ in range(b)], mx.int32)
    q = mx.random.normal((b, h, 1, d)).astype(dtype)
    flat = pool.reshape(-1, d)
    rows = (tables[:, :, None] * p + mx.arange(p)[None, None]).reshape(b, 1, -1)[..., :n]
    rows = rows * (2 * hkv) + mx.arange(hkv, dtype=mx.int32)[None, :, None]
    mx.eval(pool, tables, q, rows)

    def positions() -> mx.array:
        x = pool.reshape(slots // p, -1)[tables].reshape(b, -1, 2 * hkv, d)[:, :n]
        k = mx.contiguous(x[:, :, :hkv].transpose(0, 2, 1, 3))
        v = mx.contiguous(x[:, :, hkv:].transpose(0, 2, 1, 3))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)

    def heads() -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, flat[rows], flat[rows + hkv], scale=0.125)

    # The same entries head-major: (pages, 2 Hkv, page, D), one gathered row a head's page.
    by_page = mx.contiguous(pool.reshape(slots // p, p, 2 * hkv, d).transpose(0, 2, 1, 3))
    page_rows = tables[:, None, :] * (2 * hkv) + mx.arange(hkv, dtype=mx.int32)[None, :, None]
    mx.eval(by_page, page_rows)

    def pages() -> mx.array:
        runs = by_page.reshape(-1, p * d)
        k = runs[page_rows].reshape(b, hkv, -1, d)[:, :, :n]
        v = runs[page_rows + hkv].reshape(b, hkv, -1, d)[:, :, :n]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)

    assert mx.array_equal(positions(), heads()).item()
    assert mx.array_equal(heads(), pages()).item()
    res: dict[str, float] = {}
    for name, f in [("positions", positions), ("heads", heads), ("pages", pages)] * 2:
        ts = []
        for _ in range(15):
            t = time.perf_counter()
            mx.eval(f())
            ts.append(time.perf_counter() - t)
        res[name] = sorted(ts)[len(ts) // 2] * 1e3
    print(
        f"B={b} L={n} Hkv={hkv} D={d} {dtype}: positions {res['positions']:.2f} ms, "
        f"heads {res['heads']:.2f} ms ({res['positions'] / res['heads']:.2f}x), "
        f"pages {res['pages']:.2f} ms ({res['heads'] / res['pages']:.2f}x of heads)"
    )


if __name__ == "__main__":
    bench(64, 256, 3, 9, 64)  # SmolLM2
    bench(1, 4096, 3, 9, 64)
    bench(1, 256, 3, 9, 64)
    bench(16, 512, 8, 16, 128)  # Qwen3-8B's attention
    bench(16, 512, 8, 16, 128, dtype=mx.bfloat16)
    bench(4, 2048, 2, 4, 64)
    bench(16, 256, 2, 4, 16)
    bench(16, 250, 3, 9, 64)  # lengths cut inside a page, as steps have them
    bench(64, 250, 3, 9, 64)
    bench(16, 378, 2, 4, 16)
    bench(16, 500, 8, 16, 128)
