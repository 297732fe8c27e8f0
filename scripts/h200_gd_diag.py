"""H200 diagnostic: the CUDA gated delta kernel against mlx-lm's ops on Qwen3.5-2B-sized
inputs (bfloat16 and float32), one prefill chunk and one decode step; and its speed."""

import time

import mlx.core as mx
from mlx_lm.models import gated_delta as mlx_gd

from tandem.runner import gated_delta as gd

print("kernel available:", gd.available())
for dtype in (mx.float32, mx.bfloat16):
    for b, t in ((1, 256), (16, 1)):
        ks = mx.random.split(mx.random.key(0), 6)
        q = mx.random.normal((b, t, 16, 128), key=ks[0])
        k = mx.random.normal((b, t, 16, 128), key=ks[1])
        q, k = mlx_gd.normalize_qk(q, k, inv_scale=128**-0.5, eps=1e-6)
        q, k = q.astype(dtype), k.astype(dtype)
        v = mx.random.normal((b, t, 16, 128), key=ks[2]).astype(dtype)
        g = mx.random.uniform(0.8, 1.0, (b, t, 16), key=ks[3])
        beta = mx.random.uniform(0, 1, (b, t, 16), key=ks[4]).astype(dtype)
        s0 = mx.random.normal((b, 16, 128, 128), key=ks[5]) * 0.1
        y1, s1 = gd.recurrence(q, k, v, g, beta, s0)
        y2, s2 = mlx_gd.gated_delta_ops(q, k, v, g, beta, s0)
        dy = mx.max(mx.abs(y1.astype(mx.float32) - y2.astype(mx.float32))).item()
        ds = mx.max(mx.abs(s1 - s2)).item()
        mag = mx.max(mx.abs(y2.astype(mx.float32))).item()

        def timed(fn):
            mx.eval(fn())
            t0 = time.perf_counter()
            for _ in range(5):
                mx.eval(fn())
            return (time.perf_counter() - t0) / 5 * 1e3

        args = (q, k, v, g, beta, s0)
        tk = timed(lambda args=args: gd.recurrence(*args))
        to = timed(lambda args=args: mlx_gd.gated_delta_ops(*args))
        print(
            f"{dtype} B={b} T={t}: max|dy| {dy:.3g} (|y| {mag:.3g}) max|dstate| {ds:.3g};"
            f" kernel {tk:.2f} ms, ops {to:.2f} ms"
        )
