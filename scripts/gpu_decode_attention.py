"""Decode attention per layer on the GPU, at the Qwen3-8B shape (32 query heads, 8 KV heads,
head dim 128, bf16): the paged kernel (runner/kernels.py) at several chunk sizes against
``mx.fast.scaled_dot_product_attention`` over dense buffers of the same lengths. "perhead"
is the paged kernel with one query head a block and ``--warps`` warps throughout (its layout
before 201f049), "paged" as it runs now (the split variant's blocks serving every query head
of a KV head, ``kernels.grouped``; the single variant wide for small launches,
``kernels.single_warps``); the largest difference between the two outputs is printed. (The
grouped layout was first measured here as a variant of the script's own, at 485ed01.)

Each timing chains 36 calls (a model's layers: each call's query is the output of the one
before), evaluated once, so the launch and the wait are paid once per 36 and the number is
close to the kernels' own time on the device. Median of 20, in microseconds per call.

    python scripts/gpu_decode_attention.py [--json out.json] [--chunks 512,256,128,64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

import tandem.runner  # noqa: F401, I001  (BLAS preload before mlx)
from tandem.bench.paged_attention import timeit
from tandem.runner import kernels

H, HKV, D, LAYERS, PAGE = 32, 8, 128, 36, 16


def per_call_us(fn, q: mx.array, repeats: int = 20) -> float:
    """Microseconds per call of ``fn`` chained ``LAYERS`` times from ``q`` (``timeit``'s
    median of one evaluation of the chain, after its warm-up)."""

    def chain():
        x = q
        for _ in range(LAYERS):
            x = fn(x)
        return x

    return timeit(chain, repeats) * 1e3 / LAYERS


def paged(b: int, n: int, dtype: mx.Dtype, chunk: int, warps: int) -> tuple[float, float, float]:
    """Microseconds per call of the paged kernel one head a block (``warps`` throughout) and
    as it runs, and the largest difference between their outputs."""
    kernels.CHUNK, kernels.WARPS = chunk, warps  # (template values: kernels of their own)
    pages = -(-n // PAGE)
    order = np.random.default_rng(0).permutation(b * pages + 1).astype(np.int32)
    tables = mx.array(order[: b * pages].reshape(b, pages))
    pool = mx.random.normal(((b * pages + 1) * PAGE, 2 * HKV, D)).astype(dtype)
    lengths = mx.array([n - i for i in range(b)], dtype=mx.int32)
    q = mx.random.normal((b, H, D)).astype(dtype)
    work = kernels.DecodeWork([n - i for i in range(b)], pages)
    mx.eval(pool, q, tables, lengths)

    def ours(x):
        return kernels.paged_decode(x, pool, tables, lengths, D**-0.5, PAGE, work)

    key = (H, HKV, D, False, dtype)  # one head a block, ``warps`` throughout: as before
    kernels.UNGROUPED.add(key)
    kernels.NARROW.add(key)
    want = ours(q).astype(mx.float32)
    perhead = per_call_us(ours, q)
    kernels.UNGROUPED.discard(key)
    kernels.NARROW.discard(key)
    diff = mx.abs(want - ours(q).astype(mx.float32)).max().item()
    return perhead, per_call_us(ours, q), diff


_FLOOR = """
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < q_shape[0] * q_shape[1] * q_shape[2]) out[i] = q[i];
"""


def floor_us(b: int, dtype: mx.Dtype) -> tuple[float, float]:
    """A custom kernel that copies q (the same inputs as the paged kernel's call), and one
    that takes q alone: the per-call cost of MLX's custom-kernel dispatch, chained."""
    kern = mx.fast.cuda_kernel(
        name="tandem_floor",
        input_names=["q", "pool", "tables"],
        output_names=["out"],
        source=_FLOOR,
    )
    lone = mx.fast.cuda_kernel(
        name="tandem_floor_q", input_names=["q"], output_names=["out"], source=_FLOOR
    )
    pool = mx.random.normal((4096, 2 * HKV, D)).astype(dtype)
    tables = mx.zeros((b, 64), dtype=mx.int32)
    q = mx.random.normal((b, H, D)).astype(dtype)
    mx.eval(pool, tables, q)
    n = b * H * D

    def call(x, k, inputs):
        return k(
            inputs=inputs,
            template=[("T", dtype)],
            grid=(n, 1, 1),
            threadgroup=(128, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
        )[0]

    full = per_call_us(lambda x: call(x, kern, [x, pool, tables]), q)
    alone = per_call_us(lambda x: call(x, lone, [x]), q)
    return full, alone


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
    p.add_argument("--warps", default="4", help="warps per block (kernels.WARPS)")
    p.add_argument("--floor", action="store_true", help="also a copying custom kernel's cost")
    args = p.parse_args()
    dtype = mx.bfloat16
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            row = {"batch": b, "length": n, "sdpa_us": round(dense(b, n, dtype), 2)}
            if args.floor:
                full, alone = floor_us(b, dtype)
                row["copy_kernel_us"], row["copy_kernel_q_only_us"] = (
                    round(full, 2),
                    round(alone, 2),
                )
                row["add_us"] = round(per_call_us(lambda x: x + 1, mx.zeros((b, H, D), dtype)), 2)
            for c in chunks:
                for w in (int(x) for x in args.warps.split(",")):
                    perhead, ours, diff = paged(b, n, dtype, c, w)
                    row[f"perhead_c{c}_w{w}_us"] = round(perhead, 2)
                    row[f"paged_c{c}_w{w}_us"] = round(ours, 2)
                    row[f"paged_c{c}_w{w}_maxdiff"] = diff
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"device": str(mx.default_device()), "layers": LAYERS, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
