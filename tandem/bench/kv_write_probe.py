"""Does an in-place KV write survive pipelining? (GPU question; see docs/design.md.)

Each "step" writes one position per row into a (rows*heads, capacity, dim) buffer and reads
it back through SDPA, like a decode layer. Modes: ``sync`` (wait for step N before building
N+1), ``pipelined`` (submit N+1 before waiting on N, one buffer), ``parity`` (pipelined, two
buffers alternating, each step also writing its parent's entry).

    python -m tandem.bench.kv_write_probe --rows 256 --capacity 1024
"""

from __future__ import annotations

import argparse
import time


def run(mode: str, rows: int, heads: int, cap: int, dim: int, steps: int, layers: int) -> float:
    import mlx.core as mx

    dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    nbuf = 2 if mode == "parity" else 1
    bufs = [
        [mx.zeros((rows * heads, cap, dim), dtype=dt) for _ in range(layers)] for _ in range(nbuf)
    ]
    mx.eval(bufs)
    idx = mx.arange(rows * heads)
    q = mx.random.normal((rows, heads, 1, dim)).astype(dt)
    prev_new: list[mx.array] | None = None
    prev_pos: mx.array | None = None
    pending = None
    t0 = 0.0
    for s in range(steps + 5):
        if s == 5:
            mx.eval(pending)
            t0 = time.perf_counter()
        pos = mx.full((rows * heads,), s, dtype=mx.int32)
        b = bufs[s % nbuf]
        outs, news = [], []
        for layer in range(layers):
            new = (q.reshape(rows * heads, dim) + s).astype(dt)
            if mode == "parity" and prev_new is not None:
                b[layer][mx.concatenate([idx, idx]), mx.concatenate([prev_pos, pos])] = (
                    mx.concatenate([prev_new[layer], new])
                )
            else:
                b[layer][idx, pos] = new
            news.append(new)
            kv = b[layer].reshape(rows, heads, cap, dim)[:, :, : s + 1, :]
            outs.append(mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.1))
        out = mx.sum(mx.stack([o.sum() for o in outs]))
        prev_new, prev_pos = news, pos
        if mode == "sync":
            mx.eval(out)
        else:
            mx.async_eval(out, *b)
            if pending is not None:
                mx.eval(pending)
        pending = out
    mx.eval(pending)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    import tandem.runner  # noqa: F401

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    for mode in ("sync", "pipelined", "parity"):
        ms = run(mode, a.rows, a.heads, a.capacity, a.dim, a.steps, a.layers)
        print(
            f"kv write {mode:>9}: {ms:.2f} ms/step (rows={a.rows} cap={a.capacity} "
            f"layers={a.layers})",
            flush=True,
        )


if __name__ == "__main__":
    main()
