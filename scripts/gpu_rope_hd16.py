"""MLX's CUDA rope with an offset per token, by rotary width, heads and tokens: which fail.

    python scripts/gpu_rope_hd16.py

On the H200 (mlx-cuda 0.32.4, fc32873), 16 dims of (T, H, 1, 16) inputs with an offset per
token (Tandem's layout for a step of two or more prompts: one token per row) failed with
``cudaGraphAddKernelNode ... invalid argument`` (``cudaLaunchKernelExC`` with
MLX_USE_CUDA_GRAPHS=0) from T = 128 at one to four heads and from T = 64 at 32 heads;
32-256 dims did not fail. (In Tandem's check deepseek_v3's 8 rope dims failed too: this
sweep now has 8.) The last lines compare layouts at 16 dims: (1, H, T, D) with one offset
for its one row (the sequence layout, which the recurrent families' steps take), and
(T, 1, H, D) with one per row.
"""

import mlx.core as mx

bad = []
for d in (8, 16, 32, 64, 128, 256):
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
