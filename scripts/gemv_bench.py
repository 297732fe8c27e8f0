"""Tandem's GEMV kernel (``tandem.runner.gemv``) against MLX's one-row matmul, on a GPU.

For each weight shape of the Qwen3-8B and Qwen3-0.6B shapes (bf16): whether the kernel's
output is bitwise equal to ``x @ w.T`` for a few random inputs, then the time of one product
per call and the bandwidth it reads at, for MLX and for kernel variants (rows a block, loads
in flight), over enough distinct weights (about 1 GB a shape) that they come from memory, not
the L2 cache. Prints one table; reports nothing on the CPU (no kernel there).

    python3 scripts/gemv_bench.py [--repeats 20] [--variants 8x1,8x2,8x4,8x8,4x4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from tandem.runner import gemv

SHAPES = {
    "8B q/o": (4096, 4096),
    "8B k/v": (1024, 4096),
    "8B gate/up": (12288, 4096),
    "8B down": (4096, 12288),
    "8B lm_head": (151936, 4096),
    "0.6B q": (2048, 1024),
    "0.6B k/v": (1024, 1024),
    "0.6B o": (1024, 2048),
    "0.6B gate/up": (3072, 1024),
    "0.6B down": (1024, 3072),
    "0.6B lm_head": (151936, 1024),
}


def timed(
    fn: Callable[[mx.array, mx.array], mx.array], ws: list[mx.array], x: mx.array, repeats: int
) -> float:
    """Median seconds per product over ``repeats`` passes over every weight."""
    mx.eval([fn(w, x) for w in ws])  # warm-up (and JIT)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn(w, x) for w in ws])
        times.append((time.perf_counter() - t0) / len(ws))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="8x1,8x2,8x4,8x8,4x4,4x8")
    ap.add_argument("--bytes", type=float, default=1e9, help="weights a shape, in bytes")
    args = ap.parse_args()
    if not gemv.enabled():
        print("no CUDA backend: nothing to measure")
        return
    variants = [tuple(int(v) for v in s.split("x")) for s in args.variants.split(",")]
    dt = mx.bfloat16
    head = f"{'shape':<14} {'N x K':>13} {'equal':>5} {'MLX us':>8} {'GB/s':>6}"
    head += "".join(f" {f'{r}x{u} us':>9} {'GB/s':>6}" for r, u in variants)
    print(head)
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        count = max(2, int(args.bytes // nbytes))
        ws = [mx.random.normal((n, k), key=mx.random.key(i)).astype(dt) for i in range(count)]
        mx.eval(ws)
        equal = True
        for seed in range(3):
            x = mx.random.normal((1, k), key=mx.random.key(100 + seed)).astype(dt)
            for w in ws[:2]:
                for r, u in variants:
                    equal &= mx.array_equal(x @ w.T, gemv.gemv(w, x, r, u)).item()
            # views 1 and 2 values into a row (the kernel's unaligned orders, as MLX's)
            wide = mx.random.normal((1, k + 2), key=mx.random.key(200 + seed)).astype(dt)
            for off in (1, 2):
                xv = wide[:, off : off + k]
                equal &= mx.array_equal(xv @ ws[0].T, gemv.gemv(ws[0], xv)).item()
        x = mx.random.normal((1, 1, k), key=mx.random.key(7)).astype(dt)
        base = timed(lambda w, x: x @ w.T, ws, x, args.repeats)
        line = f"{name:<14} {f'{n}x{k}':>13} {str(equal):>5} {base * 1e6:8.1f} "
        line += f"{nbytes / base / 1e9:6.0f}"
        for r, u in variants:
            t = timed(lambda w, x, r=r, u=u: gemv.gemv(w, x, r, u), ws, x, args.repeats)
            line += f" {t * 1e6:9.1f} {nbytes / t / 1e9:6.0f}"
        print(line, flush=True)
        del ws
        mx.clear_cache()


if __name__ == "__main__":
    main()
