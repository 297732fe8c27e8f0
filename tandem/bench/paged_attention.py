"""Paged decode attention, one layer, one step: the device kernel and the pure-MLX gather path
against ``mx.fast.scaled_dot_product_attention`` over dense buffers of the same tokens; page
sizes; and the pool write path (one scatter per layer per step) with a step in flight.

    python -m tandem.bench.paged_attention --json out.json

Cases: ``ragged`` (63 sequences of 256 tokens + one of 8,192) and ``uniform`` (64 x 1,024);
16 query heads, 8 KV heads, head dim 128 (Qwen3-0.6B's attention); bf16 on a GPU, f32 on CPU.
The dense floor runs one SDPA per length class over exactly its tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import tandem.runner  # noqa: F401, I001  (BLAS preload before mlx)
from tandem.runner import kernel_check, kernels

H, HKV, D = 16, 8, 128


def timeit(fn, repeats: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def case(lengths: list[int], page: int, dtype: mx.Dtype, seed: int = 0) -> dict:
    rng = random.Random(seed)
    need = sum(-(-n // page) for n in lengths)
    num_pages = need + 8
    order = list(range(num_pages))
    rng.shuffle(order)  # pages of a sequence are scattered over the pool
    tables, it = [], iter(order)
    width = max(-(-n // page) for n in lengths)
    for n in lengths:
        row = [next(it) for _ in range(-(-n // page))]
        tables.append(row + [0] * (width - len(row)))
    kv = mx.random.normal((num_pages * page, 2 * HKV, D)).astype(dtype)
    q = mx.random.normal((len(lengths), H, D)).astype(dtype)
    t = mx.array(np.asarray(tables, dtype=np.int32))
    lens = mx.array(lengths, dtype=mx.int32)
    mx.eval(kv, q, t, lens)
    return {"q": q, "kv": kv, "tables": t, "lengths": lens, "page": page, "raw": lengths}


def dense_floor(c: dict) -> float:
    """SDPA over dense (B, Hkv, L, D) buffers of exactly the tokens, one per length class."""
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(c["raw"]):
        classes.setdefault(n, []).append(i)
    bufs = []
    for n, rows in classes.items():
        kd = mx.random.normal((len(rows), HKV, n, D)).astype(c["q"].dtype)
        vd = mx.random.normal((len(rows), HKV, n, D)).astype(c["q"].dtype)
        qd = c["q"][mx.array(rows)][:, :, None, :]
        mx.eval(kd, vd, qd)
        bufs.append((qd, kd, vd))

    def run():
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5) for q, k, v in bufs]

    return timeit(run)


def gather(c: dict) -> float:
    """The runner's CPU path: groups by length, gather whole pages, fused SDPA."""
    from tandem.runner.attention import gather_attention
    from tandem.runner.step_context import AttnView, DecodeGroup
    from tandem.runner.step_groups import group_decodes

    page, raw = c["page"], c["raw"]
    tables = np.asarray(c["tables"])
    view = AttnView([], [], None, kernel=False)
    for g in group_decodes(raw):
        width = -(-max(raw[i] for i in g) // page)
        view.decodes.append(DecodeGroup(g, tables[g][:, :width], [raw[i] for i in g], page))
    q = c["q"][:, :, None, :]
    fresh = mx.zeros((q.shape[0], HKV, 1, D), dtype=q.dtype)

    def run():
        return gather_attention(view, q, fresh, fresh, c["kv"], D**-0.5)

    return timeit(run)


def kernel(c: dict) -> float:
    work = kernels.DecodeWork(c["raw"])  # once per step in the runner, shared by every layer

    def run():
        return kernels.paged_decode(
            c["q"], c["kv"], c["tables"], c["lengths"], D**-0.5, c["page"], work
        )

    return timeit(run)


def write_path(dtype: mx.Dtype, pool_tokens: int, tokens: int, double: bool, steps: int = 30):
    """ms per step of 28 layers' scatters of ``tokens`` new K/V rows into a pool of
    ``pool_tokens`` slots, the next step submitted before the previous is waited on."""
    from tandem.runner.layers import LayerSpec
    from tandem.runner.paged import PagePool

    specs = [LayerSpec(HKV, D, HKV, D, dtype)] * 28
    pool = PagePool(specs, pool_tokens // 16, 16, double_buffer=double)
    new = mx.random.normal((tokens, HKV, D)).astype(dtype)
    mx.eval(new)
    pending = None
    t0 = 0.0
    for s in range(steps + 3):
        if s == 3:
            mx.eval(pending)
            t0 = time.perf_counter()
        host = np.arange(tokens, dtype=np.int32) + (s * tokens) % (pool_tokens - tokens)
        slots = mx.array(host)
        pool.begin_step(host, slots)
        outs = []
        for layer in range(28):
            pool.write(layer, slots, new + s, new - s)
            outs.append(pool.layer(layer)[slots[:1]].sum())
        step = mx.sum(mx.stack(outs))
        mx.async_eval(step, *pool.arrays())
        if pending is not None:
            mx.eval(pending)
        pending = step
    mx.eval(pending)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--pages", default="8,16,32,64")
    args = p.parse_args()
    gpu = mx.default_device() != mx.cpu
    dtype = mx.bfloat16 if gpu else mx.float32
    has_kernel = kernel_check.available(D, H, HKV, dtype)
    shapes = {"ragged": [256] * 63 + [8192], "uniform": [1024] * 64}
    out: dict = {"device": str(mx.default_device()), "kernel": has_kernel, "cases": {}}
    for name, lengths in shapes.items():
        row: dict = {"dense_sdpa_ms": dense_floor(case(lengths, 16, dtype))}
        for page in (int(x) for x in args.pages.split(",")):
            c = case(lengths, page, dtype)
            row[f"gather_p{page}_ms"] = gather(c)
            if has_kernel:
                row[f"kernel_p{page}_ms"] = kernel(c)
        out["cases"][name] = row
        print(name, json.dumps(row), flush=True)
    pool_tokens = 1 << 17 if gpu else 1 << 14
    out["write_ms_per_step"] = {
        f"{'double' if d else 'single'}_{n}tok": write_path(dtype, pool_tokens, n, d)
        for d in (False, True)
        for n in (64, 1024)
    }
    print(json.dumps(out["write_ms_per_step"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
