"""Decode attention per layer on the GPU, at the Qwen3-8B shape (32 query heads, 8 KV heads,
head dim 128, bf16): the paged kernel (runner/kernels.py) at several chunk sizes against
``mx.fast.scaled_dot_product_attention`` over dense buffers of the same lengths, and an
experimental variant, "grouped": one block per (work item, KV head) serving the query heads
that share it (each K and V load feeds H / HKV dot products), always writing partials that
kernels' merge combines. "perhead" is the paged kernel with one query head a block and
``--warps`` warps throughout (as before 201f049), "paged" as it runs now (its split variant
grouped, ``kernels.grouped``; its single variant wide for small launches,
``kernels.single_warps``); the grouped outputs' largest difference from "perhead" is
printed.

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


def paged(
    b: int, n: int, dtype: mx.Dtype, chunk: int, warps: int
) -> tuple[float, float, float, float]:
    """Microseconds per call of the paged kernel one head a block, the paged kernel as it
    runs (the split variant grouped: ``kernels.grouped``) and this script's grouped variant;
    and the largest difference of either grouped output from the first."""
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

    def grouped(x):
        return grouped_decode(x, pool, tables, lengths, D**-0.5, work)

    key = (H, HKV, D, False, dtype)  # one head a block, ``warps`` throughout: as before
    kernels.UNGROUPED.add(key)
    kernels.NARROW.add(key)
    want = ours(q).astype(mx.float32)
    perhead = per_call_us(ours, q)
    kernels.UNGROUPED.discard(key)
    kernels.NARROW.discard(key)
    diff = max(
        mx.abs(want - grouped(q).astype(mx.float32)).max().item(),
        mx.abs(want - ours(q).astype(mx.float32)).max().item(),
    )
    return perhead, per_call_us(ours, q), per_call_us(grouped, q), diff


_GROUPED = """
    const int W = NW;
    const int E = D / 32;
    const int G = H / HKV;
    const int MAXP = dims[0];
    int item = blockIdx.x / HKV;
    int hk = blockIdx.x % HKV;
    int b = work[2 * item];
    int chunk = work[2 * item + 1];
    int warp = threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int first = chunk * CHUNK;
    int len = min(lengths[b], first + CHUNK);
    float sc = scale[0];
    float qv[G][E];
    float acc[G][E];
    float m[G];
    float l[G];
    for (int g = 0; g < G; ++g) {
        for (int e = 0; e < E; ++e) {
            qv[g][e] = static_cast<float>(q[((size_t)b * H + hk * G + g) * D + lane * E + e]) * sc;
            acc[g][e] = 0.0f;
        }
        m[g] = __int_as_float(0xff800000);
        l[g] = 0.0f;
    }
    for (int j = first + warp; j < len; j += U * W) {
        size_t kb[U];
        float kf[U][E];
        float vf[U][E];
        float s[U][G];
        for (int u = 0; u < U; ++u) {
            int ju = j + u * W < len ? j + u * W : j;
            size_t slot = (size_t)tables[(size_t)b * MAXP + ju / P] * P + (ju % P);
            kb[u] = (slot * 2 * HKV + hk) * D + lane * E;
        }
        for (int u = 0; u < U; ++u)
            for (int e = 0; e < E; ++e) {
                kf[u][e] = static_cast<float>(kv_pool[kb[u] + e]);
                vf[u][e] = static_cast<float>(kv_pool[kb[u] + (size_t)HKV * D + e]);
            }
        for (int u = 0; u < U; ++u)
            for (int g = 0; g < G; ++g) {
                s[u][g] = 0.0f;
                for (int e = 0; e < E; ++e) s[u][g] += qv[g][e] * kf[u][e];
            }
        for (int off = 16; off > 0; off /= 2)
            for (int u = 0; u < U; ++u)
                for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], off);
        for (int g = 0; g < G; ++g) {
            float mn = m[g];
            for (int u = 0; u < U; ++u) {
                if (j + u * W >= len) s[u][g] = __int_as_float(0xff800000);
                mn = fmaxf(mn, s[u][g]);
            }
            float c = __expf(m[g] - mn);
            l[g] *= c;
            for (int e = 0; e < E; ++e) acc[g][e] *= c;
            for (int u = 0; u < U; ++u) {
                float p = __expf(s[u][g] - mn);
                l[g] += p;
                for (int e = 0; e < E; ++e) acc[g][e] += p * vf[u][e];
            }
            m[g] = mn;
        }
    }
    __shared__ float sm[NW][G];
    __shared__ float sl[NW][G];
    __shared__ float sacc[NW][G][D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
        for (int e = 0; e < E; ++e) sacc[warp][g][lane * E + e] = acc[g][e];
    }
    __syncthreads();
    for (int g = warp; g < G; g += W) {
        int h = hk * G + g;
        float M = sm[0][g];
        for (int w = 1; w < W; ++w) M = fmaxf(M, sm[w][g]);
        float L = 0.0f;
        for (int w = 0; w < W; ++w) L += sl[w][g] == 0.0f ? 0.0f : sl[w][g] * __expf(sm[w][g] - M);
        for (int e = 0; e < E; ++e) {
            int d = lane * E + e;
            float o = 0.0f;
            for (int w = 0; w < W; ++w)
                o += sl[w][g] == 0.0f ? 0.0f : sacc[w][g][d] * __expf(sm[w][g] - M);
            part[((size_t)item * H + h) * D + d] = o / L;
        }
        if (lane == 0) lse[(size_t)item * H + h] = M + __logf(L);
    }
"""
_grouped = []


def grouped_decode(q, pool, tables, lengths, scale, work) -> mx.array:
    if not _grouped:
        _grouped.append(
            mx.fast.cuda_kernel(
                name="tandem_grouped_decode",
                input_names=["q", "kv_pool", "tables", "lengths", "work", "scale", "dims"],
                output_names=["part", "lse"],
                source=_GROUPED,
            )
        )
    b, h, d = q.shape
    nw = kernels.WARPS
    part, lse = _grouped[0](
        inputs=[q, pool, tables, lengths, work.items, kernels._scale(scale), work.dims],
        template=[
            ("T", q.dtype),
            ("H", h),
            ("HKV", HKV),
            ("D", d),
            ("P", PAGE),
            ("NW", nw),
            ("CHUNK", kernels.CHUNK),
            ("U", kernels.UNROLL),
        ],
        grid=(work.num_items * HKV * 32 * nw, 1, 1),
        threadgroup=(32 * nw, 1, 1),
        output_shapes=[(work.num_items, h, d), (work.num_items, h)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = kernels._build("merge")(
        inputs=[part, lse, work.offsets],
        template=[("T", q.dtype), ("H", h), ("D", d)],
        grid=(b * h * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out


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
                    perhead, ours, grouped, diff = paged(b, n, dtype, c, w)
                    row[f"perhead_c{c}_w{w}_us"] = round(perhead, 2)
                    row[f"paged_c{c}_w{w}_us"] = round(ours, 2)
                    row[f"grouped_c{c}_w{w}_us"] = round(grouped, 2)
                    row[f"grouped_c{c}_w{w}_maxdiff"] = diff
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"device": str(mx.default_device()), "layers": LAYERS, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
