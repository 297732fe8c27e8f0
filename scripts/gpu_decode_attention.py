"""Decode attention per layer on the GPU, at the Qwen3-8B shape (32 query heads, 8 KV heads,
head dim 128, bf16): the paged kernel (runner/kernels.py) at several chunk sizes against
``mx.fast.scaled_dot_product_attention`` over dense buffers of the same lengths.

Each timing chains 36 calls (a model's layers: each call's query is the output of the one
before), evaluated once, so the launch and the wait are paid once per 36 and the number is
close to the kernels' own time on the device. Median of 20, in microseconds per call.

    python scripts/gpu_decode_attention.py [--json out.json] [--chunks 512,256,128,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import tandem.runner  # noqa: F401, I001  (BLAS preload before mlx)
from tandem.runner import kernels

H, HKV, D, LAYERS, PAGE = 32, 8, 128, 36, 16


def per_call_us(fn, q: mx.array, repeats: int = 20) -> float:
    def chain():
        x = q
        for _ in range(LAYERS):
            x = fn(x)
        return x

    for _ in range(3):
        mx.eval(chain())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(chain())
        times.append(time.perf_counter() - t)
    return statistics.median(times) / LAYERS * 1e6


def paged(b: int, n: int, dtype: mx.Dtype, chunk: int) -> float:
    kernels.CHUNK = chunk  # (a template value: its own compiled kernels)
    pages = -(-n // PAGE)
    order = np.random.default_rng(0).permutation(b * pages + 1).astype(np.int32)
    tables = mx.array(order[: b * pages].reshape(b, pages))
    pool = mx.random.normal(((b * pages + 1) * PAGE, 2 * HKV, D)).astype(dtype)
    lengths = mx.array([n] * b, dtype=mx.int32)
    q = mx.random.normal((b, H, D)).astype(dtype)
    work = kernels.DecodeWork([n] * b, pages)
    mx.eval(pool, q, tables, lengths)
    return per_call_us(
        lambda x: kernels.paged_decode(x, pool, tables, lengths, D**-0.5, PAGE, work), q
    )


def dense(b: int, n: int, dtype: mx.Dtype) -> float:
    k = mx.random.normal((b, HKV, n, D)).astype(dtype)
    v = mx.random.normal((b, HKV, n, D)).astype(dtype)
    q = mx.random.normal((b, H, 1, D)).astype(dtype)
    mx.eval(k, v, q)
    return per_call_us(lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=D**-0.5), q)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--chunks", default="512,256,128,64")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--lengths", default="384,2048,8192")
    args = p.parse_args()
    dtype = mx.bfloat16
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            row = {"batch": b, "length": n, "sdpa_us": round(dense(b, n, dtype), 2)}
            for c in chunks:
                row[f"paged_chunk{c}_us"] = round(paged(b, n, dtype, c), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"device": str(mx.default_device()), "layers": LAYERS, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
