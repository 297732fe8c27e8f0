"""Host cost of a graph's nodes on MLX's CUDA backend: N chained elementwise ops, as MLX's
own add or as an ``mx.fast.cuda_kernel`` (a tiny and a 4 KB source, with and without
template arguments), timed from ``mx.async_eval`` until it returns (the host's submit) and
until the result is ready. Tandem's decode steps hold 36-74 custom kernels (KV writes,
paged decode, gated delta).

    python scripts/gpu_launch_cost.py
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

N = 200
BODY = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a_shape[0]) { o[i] = a[i] + 1.0f; }
"""
PAD = "\n".join(
    f"    // filler line {j} of a longer kernel source, as Tandem's are" for j in range(60)
)
tiny = mx.fast.cuda_kernel(name="probe_tiny", input_names=["a"], output_names=["o"], source=BODY)
big = mx.fast.cuda_kernel(
    name="probe_big", input_names=["a"], output_names=["o"], source=PAD + BODY
)
tmpl = mx.fast.cuda_kernel(
    name="probe_tmpl",
    input_names=["a"],
    output_names=["o"],
    source=BODY.replace("1.0f", "(float)W"),
)


def chain(kind: str, x: mx.array) -> mx.array:
    for _ in range(N):
        if kind == "add":
            x = x + 1.0
        else:
            k = {"tiny": tiny, "big": big, "template": tmpl}[kind]
            kw = {"template": [("W", 1)]} if kind == "template" else {}
            (x,) = k(
                inputs=[x],
                grid=(x.size, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[x.shape],
                output_dtypes=[x.dtype],
                **kw,
            )
    return x


x0 = mx.zeros((4096,))
mx.eval(x0)
for kind in ("add", "tiny", "big", "template") * 2:
    subs, totals = [], []
    for _ in range(12):
        y = chain(kind, x0)
        t = time.perf_counter()
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        subs.append(t1 - t)
        totals.append(t2 - t)
    assert y[0].item() == N
    print(
        f"{kind:9s} {N} nodes: submit {statistics.median(subs) * 1e6 / N:6.2f} us/node, "
        f"done {statistics.median(totals) * 1e6 / N:6.2f} us/node"
    )
