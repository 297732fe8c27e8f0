"""What MLX's CPU backend spends on transcendental ops, and what that does to an SDPA.

    python scripts/cpu_exp_probe.py

Per element over 2M float32 (and exp in float16 / bfloat16, and compiled), against numpy's
exp; then MLX's CPU SDPA of 8 causal sequences of 256 tokens with tiny llama's heads (4 query,
2 KV, 16 wide), split into its matmul and softmax; then 8 one-sequence SDPA calls on one CPU
stream and alternating between two (docs/benchmarks.md, "Where the CPU's prefill attention
goes"). Run it with OPENBLAS_NUM_THREADS=1 to see the two streams overlap.
"""

import time

import tandem.runner  # noqa: F401  (preloads BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def ms(f, n: int = 10) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


n = 1 << 21
x = mx.random.normal((n,))
mx.eval(x)
ops = {
    "exp": mx.exp,
    "log": lambda a: mx.log(mx.abs(a)),
    "sqrt": lambda a: mx.sqrt(mx.abs(a)),
    "rsqrt": lambda a: mx.rsqrt(mx.abs(a)),
    "sin": mx.sin,
    "erf": mx.erf,
    "sigmoid": mx.sigmoid,
    "abs": mx.abs,
    "square": mx.square,
    "add": lambda a: a + 1,
}
for name, op in ops.items():
    base = ms(lambda: mx.eval(mx.abs(x))) if name in ("log", "sqrt", "rsqrt") else 0.0
    t = ms(lambda op=op: mx.eval(op(x))) - base
    print(f"mx.{name}: {t / n * 1e6:.2f} ns an element")
for dt in (mx.float16, mx.bfloat16):
    y = x.astype(dt)
    mx.eval(y)
    print(f"mx.exp {dt}: {ms(lambda y=y: mx.eval(mx.exp(y))) / n * 1e6:.2f} ns an element")
compiled = mx.compile(lambda a: mx.exp(a))
print(f"mx.exp compiled: {ms(lambda: mx.eval(compiled(x))) / n * 1e6:.2f} ns an element")
xn = np.array(x)
print(f"np.exp: {ms(lambda: np.exp(xn)) / n * 1e6:.2f} ns an element")

h, hkv, d, s = 4, 2, 16, 256
q = mx.random.normal((8, h, s, d))
k = mx.random.normal((8, hkv, s, d))
v = mx.random.normal((8, hkv, s, d))
mx.eval(q, k, v)


def sdpa():
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal"))


print(f"SDPA 8 x {s} causal: {ms(sdpa):.2f} ms")
qq = (q * 0.25).reshape(8, hkv, h // hkv, s, d)
scores = qq @ k[:, :, None].swapaxes(-1, -2)
mx.eval(qq, scores)
print(f"  its scores matmul: {ms(lambda: mx.eval(qq @ k[:, :, None].swapaxes(-1, -2))):.2f} ms")
print(f"  its softmax: {ms(lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True))):.2f} ms")
streams = [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)]


def calls(two: bool):
    outs = []
    for i in range(8):
        with mx.stream(streams[i % 2 if two else 0]):
            outs.append(
                mx.fast.scaled_dot_product_attention(
                    q[i : i + 1], k[i : i + 1], v[i : i + 1], scale=0.25, mask="causal"
                )
            )
    mx.eval(*outs)


print(f"8 one-sequence SDPA calls, one stream: {ms(lambda: calls(False)):.2f} ms")
print(f"8 one-sequence SDPA calls, two streams: {ms(lambda: calls(True)):.2f} ms")
