"""The paged decode kernel's start-up check (``kernel_check.available``) on the device for
several attention shapes, float and quantized pages: which pass (both variants, single and
split, against the gather path). Then one layer at the Qwen3-8B shape, 384 and 32k keys.

    python scripts/gpu_kernel_check.py
"""

import tandem.runner  # noqa: F401, I001  (BLAS preload before mlx)
import mlx.core as mx

from tandem.runner import kernel_check, kernels
from tandem.runner.kv_quant import KVQuant

SHAPES = [(128, 32, 8), (128, 16, 8), (64, 16, 2), (128, 40, 8), (256, 16, 2), (96, 12, 4)]
SHAPES += [(128, 14, 2), (64, 64, 8), (128, 8, 8)]
for d, h, hkv in SHAPES:
    for q in (None, KVQuant(8), KVQuant(4)):
        ok = kernel_check.available(d, h, hkv, mx.bfloat16, q)
        print(d, h, hkv, "bf16" if q is None else f"int{q.bits}", ok, kernels.grouped(h, hkv, d))
print("float32 64/16/2", kernel_check.available(64, 16, 2, mx.float32))
