"""MLX's CUDA rope with per-token offsets, by head dim, heads and tokens: which shapes fail.

    python scripts/gpu_rope_hd16.py

On the H200 (mlx-cuda 0.32.4, fc32873) every (T, H, 1, 16) input with T * H >= 256 or so
failed with ``cudaGraphAddKernelNode ... invalid argument`` (``cudaLaunchKernelExC`` with
MLX_USE_CUDA_GRAPHS=0); head dims 32-256 and the (1, H, T, 16) layout did not. Tandem's
steps of several prompts take that layout (one token per row, offsets per token), so a model
with rope over 16 dims cannot prefill two prompts in one step on CUDA; real models' heads are
64 and wider, the tiny test families' are 16.
"""

import mlx.core as mx

bad = []
for d in (16, 32, 64, 128, 256):
    for h in (1, 4, 32):
        for t in (2, 8, 64, 128, 256, 293, 1024, 4096):
            for trad in (False, True):
                x = mx.random.normal((t, h, 1, d)).astype(mx.bfloat16)
                try:
                    y = mx.fast.rope(
                        x, d, traditional=trad, base=1e4, scale=1.0, offset=mx.arange(t)
                    )
                    mx.eval(y)
                except RuntimeError:
                    bad.append((d, h, t, trad))
print("failed (dims, heads, tokens, traditional):", bad)
for d in (16, 64):
    for shape in ((293, 4, 1, d), (1, 4, 293, d), (293, 1, 4, d)):
        x = mx.random.normal(shape)
        try:
            mx.eval(
                mx.fast.rope(
                    x, d, traditional=False, base=1e4, scale=1.0, offset=mx.arange(shape[0])
                )
            )
            print("float32", shape, "ok")
        except RuntimeError as e:
            print("float32", shape, "failed:", e)
